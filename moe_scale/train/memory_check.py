"""Pre-flight memory check: refuse a model that cannot fit before allocating it.

The model is built on the meta device (no memory), its parameters counted as this rank will hold them (its
local experts, every dense parameter), and a lower bound on the bytes they need compared with what this process
can use: the GPU's total memory, or on CPU the host's available memory shared by the processes on the node. The
bound counts weights, gradients and optimizer state with ZeRO's partitioning at its most favourable and no
activations, so it refuses only what cannot fit however the run goes; `moe-scale plan` gives the full estimate.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import psutil
import torch
from deepspeed.moe.utils import is_moe_param
from torch import nn

from moe_scale.errors import UserError
from moe_scale.layout.ds_config import zero_stage

GIB = 2**30


def parameter_bytes(model: nn.Module, ds_config: dict[str, Any], optimizer: str, world: int,
                    expert_data_parallel: int) -> tuple[int, int, float]:
    """(dense parameters, expert parameters on this rank, least bytes they need on this rank)."""
    dense = sum(p.numel() for p in model.parameters() if not is_moe_param(p))
    experts = sum(p.numel() for p in model.parameters() if is_moe_param(p))
    half = ds_config.get("bf16", {}).get("enabled") or ds_config.get("fp16", {}).get("enabled")
    weight, grad, master = (2, 2, 4) if half else (4, 4, 0)
    stage = zero_stage(ds_config)

    def per_param(group: int, adam: bool) -> float:
        state = (8 if adam else 0) + master
        return weight + (grad / group if stage >= 2 else grad) + (state / group if stage >= 1 else state)

    total = dense * per_param(world, True) + experts * per_param(expert_data_parallel, optimizer != "factored")
    return dense, experts, total


def usable_bytes(device: torch.device) -> tuple[float, str]:
    """(bytes this process may use, where they come from)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"the GPU has {total / GIB:.1f} GiB"
    available = psutil.virtual_memory().available
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local > 1:
        return available / local, (f"its share of the {available / GIB:.1f} GiB available on this host, shared by "
                                    f"{local} processes, is {available / local / GIB:.1f} GiB")
    return available, f"this host has {available / GIB:.1f} GiB available"


def check_model_fits(build: Callable[[], nn.Module], ds_config: dict[str, Any], optimizer: str, world: int,
                     ep_size: int, device: torch.device) -> None:
    """Build the model on the meta device and refuse it in one line if its parameters alone cannot fit."""
    with torch.device("meta"):
        model = build()
    dense, experts, need = parameter_bytes(model, ds_config, optimizer, world, max(world // ep_size, 1))
    have, where = usable_bytes(device)
    if need > have:
        raise UserError(
            f"the model cannot fit: this process would hold {dense / 1e6:,.1f}M dense and {experts / 1e6:,.1f}M "
            f"expert parameters, at least {need / GIB:,.1f} GiB with their gradients and optimizer state (before "
            f"activations), but {where}; use fewer or smaller experts, or spread them over more processes"
            + ("" if zero_stage(ds_config) >= 2 else " with ZeRO stage 2 in --ds-config"))
