"""`accelerate launch` as a launcher: its DeepSpeed plugin names the DeepSpeed JSON moe_scale's own engine uses.

`accelerate launch --num_processes N [--multi_gpu | --use_deepspeed ...] -m moe_scale train ...` starts the ranks
with torch.distributed's env:// variables (read as from any launcher). With its DeepSpeed plugin it also exports
the plugin's settings: the JSON file (`deepspeed_config_file`) becomes --ds-config; settings moe_scale cannot take
from the environment (a ZeRO stage or offload given without a file, a mixed precision the JSON does not enable)
are refused in one line rather than ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_scale.errors import UserError

_PLUGIN_FIELDS = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_stage",
                  "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "offload_optimizer_device",
                  "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "offload_param_device"}


def ds_config_from_accelerate(ds_config: str | None, env: dict[str, str] | None = None) -> str | None:
    """The DeepSpeed JSON to use: `ds_config` (--ds-config), or accelerate's `deepspeed_config_file` when this
    process was started by `accelerate launch --use_deepspeed`; they must agree when both are given."""
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return ds_config
    from_accelerate = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")
    if from_accelerate in ("", "None", "none"):
        fields = [name for key, name in _PLUGIN_FIELDS.items() if env.get(key, "none").lower() not in ("", "none")]
        if fields:
            raise UserError(f"accelerate's DeepSpeed plugin sets {', '.join(fields)} without a deepspeed_config_file; "
                            f"moe_scale takes DeepSpeed settings from a JSON file: set deepspeed_config_file (e.g. "
                            f"ds_configs/zero2_ep.json) in the accelerate config instead")
        return ds_config
    if ds_config is not None and Path(ds_config).resolve() != Path(from_accelerate).resolve():
        raise UserError(f"--ds-config {ds_config} and accelerate's deepspeed_config_file {from_accelerate} differ; "
                        f"give the DeepSpeed JSON in one place")
    _check_mixed_precision(from_accelerate, env.get("ACCELERATE_MIXED_PRECISION", "no"))
    return from_accelerate


def _check_mixed_precision(path: str, precision: str) -> None:
    if precision not in ("bf16", "fp16"):
        return
    try:
        enabled = bool(json.loads(Path(path).read_text()).get(precision, {}).get("enabled"))
    except (OSError, ValueError, AttributeError):
        return   # the JSON's own errors are reported where it is loaded
    if not enabled:
        raise UserError(f"accelerate's mixed_precision {precision} is not enabled in {path}; moe_scale takes "
                        f"precision from the DeepSpeed JSON: add \"{precision}\": {{\"enabled\": true}} there, or set "
                        f"mixed_precision: no in the accelerate config")
