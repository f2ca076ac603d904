"""DeepSpeed engine setup: optimizer groups, learning-rate schedule, deepspeed.initialize."""

from __future__ import annotations

import math
from typing import Any

import deepspeed
import torch
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

from moe_scale.config import TrainConfig


def inverse_sqrt_schedule(warmup_steps: int):
    """Shazeer et al. App. C.1: linear warm-up, then proportional to 1/sqrt(step); 1.0 at the peak."""
    def factor(step: int) -> float:
        step = step + 1
        if warmup_steps and step <= warmup_steps:
            return step / warmup_steps
        return math.sqrt(max(warmup_steps, 1) / step)
    return factor


def optimizer_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Dense parameters in one group; expert parameters in one group per expert-parallel size, which is how
    DeepSpeed's ZeRO knows to partition and reduce them over the expert-data-parallel group only."""
    return split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "dense"})


def build_engine(model: nn.Module, ds_config: dict[str, Any], train: TrainConfig):
    optimizer = torch.optim.AdamW(optimizer_groups(model), lr=train.lr, weight_decay=train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_schedule(train.warmup_steps))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)
    return engine
