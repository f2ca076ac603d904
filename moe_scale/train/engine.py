"""DeepSpeed engine setup: optimizer groups, learning-rate schedule, deepspeed.initialize, the step."""

from __future__ import annotations

import math
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
from torch import nn

from moe_scale.config import TrainConfig
from moe_scale.deepspeed_internals import (backward_allreduce_is_plain_average, disable_backward_allreduce,
                                           engine_data_parallel_size, zero_norm_without_host_reads)
from moe_scale.models.vocab_parallel import connect_vocabulary, split_parameter_groups
from moe_scale.train.clipping import expert_aware_clip_
from moe_scale.train.factored_optimizer import build_optimizer
from moe_scale.layout.ds_config import zero_stage


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


class TrainingEngine:
    """The DeepSpeed engine plus the one thing we do around its step: expert-aware clipping without ZeRO."""

    def __init__(self, model: nn.Module, ds_config: dict[str, Any], train: TrainConfig):
        self.model = model
        self.clip = 0.0
        ds_config = dict(ds_config)
        if zero_stage(ds_config) == 0 and not ds_config.get("bf16", {}).get("enabled") \
                and not ds_config.get("fp16", {}).get("enabled"):
            # DeepSpeed's stage-0 norm is wrong under expert parallelism: we clip (at DeepSpeed's threshold, its
            # default where the JSON has none), and DeepSpeed must not clip again (0, not absent: absent is 1.0)
            self.clip = float(ds_config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))
            ds_config["gradient_clipping"] = 0.0
        connect_vocabulary(model, bool(ds_config.get("use_data_before_expert_parallelism", False)))
        optimizer = build_optimizer(optimizer_groups(model), train)   # --optimizer adam|factored
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_schedule(train.warmup_steps))
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                    config=ds_config, dist_init_required=False)
        zero_norm_without_host_reads(self.engine.optimizer)   # ZeRO 1/2: the norm and clipping never wait for the GPU
        self.grad_norm = None   # last step's norm: a device tensor (or DeepSpeed's float), read at log points
        # Without ZeRO, DeepSpeed's backward all-reduce flattens every gradient into a buffer and copies it back
        # (two full copies of the gradients per step, even where an expert's group has one rank): one process
        # reduces nothing, several reduce in place (`reduce_gradients_in_place`), with the same sums and averages.
        self.reduce_in_place = False
        plain = backward_allreduce_is_plain_average(self.engine)
        if zero_stage(ds_config) == 0 and plain is not None:
            single = engine_data_parallel_size(self.engine) == 1 and (not dist.is_initialized()
                                                                      or dist.get_world_size() == 1)
            if single or plain:
                disable_backward_allreduce(self.engine)
                self.reduce_in_place = not single

    def backward_and_step(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        if self.reduce_in_place and self.engine.is_gradient_accumulation_boundary():
            reduce_gradients_in_place(self.model, self.engine.data_parallel_group)
        if self.clip and self.engine.is_gradient_accumulation_boundary():
            self.grad_norm = expert_aware_clip_(self.model, self.clip)
        self.engine.step()
        if not self.clip:
            self.grad_norm = self.engine.get_global_grad_norm()


def reduce_gradients_in_place(model: nn.Module, data_parallel_group) -> None:
    """DeepSpeed's stage-0 gradient all-reduce without its copies: dense gradients summed over the data-parallel
    group (one flat buffer: they are small), each expert gradient summed in place over its expert-data-parallel
    group (skipped where that group has one rank), all divided by the data-parallel size as DeepSpeed does.
    Every rank calls it; a parameter without a gradient takes part with zeros, as in DeepSpeed."""
    world = dist.get_world_size(group=data_parallel_group)
    dense, experts = [], {}
    for param in model.parameters():
        if not param.requires_grad or param.numel() == 0:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        (experts.setdefault(param.group_name, []) if is_moe_param(param) else dense).append(param.grad)
    if dense:
        flat = torch.cat([g.reshape(-1) for g in dense])
        dist.all_reduce(flat, group=data_parallel_group)
        flat.mul_(1.0 / world)
        for grad, part in zip(dense, flat.split([g.numel() for g in dense])):
            grad.copy_(part.view_as(grad))
    expert_groups = split_parameter_groups(model) if experts else {}
    for name in sorted(experts):
        group = expert_groups[name]
        for grad in experts[name]:
            if dist.get_world_size(group=group) > 1:
                dist.all_reduce(grad, group=group)
            grad.mul_(1.0 / world)
