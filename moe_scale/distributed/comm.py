"""Collectives used inside the model; identity in a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def collective_device() -> torch.device:
    """Where small host-side tensors must live for a collective: NCCL only reduces GPU tensors."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _SumOverGroup(torch.autograd.Function):
    """All-reduce(SUM) with a backward that all-reduces the gradient (SUM) too: torch.distributed.nn.functional's
    all_reduce, which torch 2.13 deprecates (a FutureWarning on every rank) for a functional collective without
    a backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _SumOverGroup.apply(grad, ctx.group), None


class _CopiesOverGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradients over the group, in one all-reduce: tensors held as copies
    on the group's ranks, each copy's gradient one share of the whole (Megatron's copy to the tensor-parallel
    region)."""

    @staticmethod
    def forward(ctx, group, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        flat = torch.cat([g.reshape(-1) for g in grads])   # (a new tensor: autograd may hand a grad elsewhere)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ctx.group)
        return None, *(part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads))


def copies_over(group, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors`, with their gradients summed over `group` in the backward (None or one rank: themselves)."""
    if group is None or world_size(group) == 1:
        return tensors
    return _CopiesOverGroup.apply(group, *tensors)


class BatchCollectives:
    """What a gate needs from its data-parallel group (None: one process, where each is the identity).

    `sum`: t summed over the group, with a backward that sums too (so every rank gets the full gradient; a
    detached all-reduce would make router gradients too small by world_size). `gather`: the rows of every rank
    in rank order (detached: for selections over the global batch; ranks may hold different numbers of rows)
    and where this rank's rows start among them."""

    def __init__(self, group=None):
        self.group = group
        self._several = group is not None and world_size(group) > 1   # None is one process, not the world

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if not self._several:
            return t
        return _SumOverGroup.apply(t, self.group)

    def gather(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(rows of every rank in rank order, the index of this rank's first row among them)."""
        t = t.detach().contiguous()
        if not self._several:
            return t, 0
        rank = dist.get_rank(self.group)
        rows_per_rank = torch.zeros(world_size(self.group), dtype=torch.int64, device=t.device)
        rows_per_rank[rank] = t.shape[0]
        dist.all_reduce(rows_per_rank, group=self.group)
        sizes = rows_per_rank.tolist()
        padded = t.new_zeros((max(sizes), *t.shape[1:]))
        padded[: t.shape[0]] = t
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=self.group)
        return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)]), sum(sizes[:rank])
