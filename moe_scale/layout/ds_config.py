"""Load, validate and complete the DeepSpeed JSON.

DeepSpeed silently ignores unknown top-level keys, so a typo ("zero_optimisation") would train with
defaults. We reject unknown keys, and keys whose job belongs to moe_scale's own flags (batch sizes
come from --batch-size/--grad-accum; the optimizer and LR schedule from --lr/--warmup-steps).
"""

from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Any

from moe_scale.errors import UserError

# The built-in default, identical to ds_configs/cpu.json (a test keeps them equal).
DEFAULT_DS_CONFIG: dict[str, Any] = {
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1000000,
    "wall_clock_breakdown": False,
}

KNOWN_TOP_LEVEL_KEYS = frozenset("""
    train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps steps_per_print
    wall_clock_breakdown dump_state gradient_clipping prescale_gradients gradient_predivide_factor
    gradient_allreduce_op sparse_gradients fp16 bf16 bfloat16 amp torch_autocast zero_optimization
    zero_allow_untested_optimizer zero_force_ds_cpu_optimizer activation_checkpointing flops_profiler
    tensorboard wandb csv_monitor comet comms_logger communication_data_type
    seq_parallel_communication_data_type memory_breakdown disable_allgather data_types checkpoint
    elasticity autotuning compression_training data_efficiency curriculum_learning aio nebula pipeline
    progressive_layer_drop sparse_attention eigenvalue quantize_training timers hybrid_engine
    weight_quantization dataloader_drop_last mics_shard_size mics_hierarchical_params_gather
    use_data_before_expert_parallelism disable_python_gc log_level compile tensor_parallel
    expert_parallel graph_harvesting zenflow vocabulary_size
""".split())

OWNED_BY_MOE_SCALE = {
    "optimizer": "moe_scale builds Adam from --lr/--weight-decay (expert parameters in their own groups)",
    "scheduler": "moe_scale sets the learning-rate schedule from --warmup-steps",
}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def load_ds_config(path: str | None) -> dict[str, Any]:
    """The user's DeepSpeed JSON (or the built-in default), validated."""
    if path is None:
        return copy.deepcopy(DEFAULT_DS_CONFIG)
    file = Path(path)
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise UserError(f"--ds-config {path}: no such file; see ds_configs/ for examples")
    except IsADirectoryError:
        raise UserError(f"--ds-config {path} is a directory; pass a JSON file such as ds_configs/cpu.json")
    except json.JSONDecodeError as e:
        raise UserError(f"--ds-config {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})")
    validate_ds_config(raw, f"--ds-config {path}")
    return raw


def validate_ds_config(raw: Any, source: str) -> None:
    if not isinstance(raw, dict):
        raise UserError(f"{source}: expected a JSON object at the top level")
    for key in raw:
        if key in OWNED_BY_MOE_SCALE:
            raise UserError(f"{source}: remove '{key}': {OWNED_BY_MOE_SCALE[key]}")
        if key not in KNOWN_TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(key, KNOWN_TOP_LEVEL_KEYS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(f"{source}: unknown DeepSpeed key '{key}'{hint}; DeepSpeed would silently ignore it")
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UserError(f"{source}: 'zero_optimization' must be an object such as {{\"stage\": 2}}")
    if zero.get("stage", 0) == 3:
        raise UserError(f"{source}: ZeRO stage 3 cannot shard MoE layers (DeepSpeed refuses stage 3 with "
                        f"expert parallelism); use stage 2, e.g. ds_configs/zero2_ep.json — expert weights "
                        f"are already split over ranks by --ep-size")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2):
        raise UserError(f"{source}: zero_optimization.stage must be 0, 1 or 2 (got {stage!r})")
    clip = raw.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise UserError(f"{source}: gradient_clipping must be a number >= 0 (0: no clipping), got {clip!r}")


def complete_ds_config(raw: dict[str, Any], micro_batch: int, grad_accum: int, world_size: int,
                       source: str) -> dict[str, Any]:
    """Fill the batch keys from moe_scale's flags; reject JSON values that contradict them."""
    wanted = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": grad_accum,
              "train_batch_size": micro_batch * grad_accum * world_size}
    for key in BATCH_KEYS:
        if key in raw and raw[key] != "auto" and raw[key] != wanted[key]:
            raise UserError(f"{source}: '{key}' is {raw[key]} but --batch-size/--grad-accum and the world size "
                            f"give {wanted[key]}; remove it from the JSON (or set it to \"auto\")")
    done = {**copy.deepcopy(raw), **wanted}
    if done.get("zero_optimization", {}).get("stage", 0) > 0:
        done["zero_allow_untested_optimizer"] = True   # our torch AdamW is fine under ZeRO-1/2
    check_with_deepspeed(done, source)
    return done


def check_with_deepspeed(config: dict[str, Any], source: str) -> None:
    """DeepSpeed's own schema (pydantic) on the completed JSON, before the engine starts: a nested typo or a
    value of the wrong type is one line naming the key, not a traceback from deepspeed.initialize."""
    import pydantic
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig

    if config.get("fp16", {}).get("enabled") and get_accelerator().device_name() == "cpu":
        raise UserError(f"{source}: fp16 needs a GPU (DeepSpeed's loss scaler has no CPU path); on CPU use "
                        f"\"bf16\": {{\"enabled\": true}} or no half precision")
    schema_only = {key: value for key, value in copy.deepcopy(config).items() if key != "train_batch_size"}
    try:   # (without train_batch_size, which DeepSpeed checks against this process's world size)
        DeepSpeedConfig(schema_only)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        section = next((key for key, value in config.items() if isinstance(value, dict)
                        and error["loc"] and error["loc"][0] in value), None)
        key = f"{section}.{where}" if section else where
        raise UserError(f"{source}: '{key}': {error['msg']} (got {error.get('input')!r}); see "
                        f"https://www.deepspeed.ai/docs/config-json/") from None


def zero_stage(config: dict[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))
