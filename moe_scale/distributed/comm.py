"""Collectives used inside the model; identity in a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def autograd_all_reduce_sum(group):
    """A function t -> sum of t over `group` whose backward also sums (so every rank gets the full gradient).

    Used for balance statistics: a detached all-reduce would make router gradients too small by world_size.
    """
    if world_size(group) == 1:
        return _identity

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return dist_autograd.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    return reduce


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def collective_device() -> torch.device:
    """Where small host-side tensors must live for a collective: NCCL only reduces GPU tensors."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
