"""--optimizer factored: Shazeer et al. App. D's expert optimizer, AdamW for everything else.

For expert matrices, Adam with beta1 = 0 (no first moment) and a factored second moment: per matrix, a
running average of the row means and of the column means of g^2; the second-moment estimate is their
outer product divided by the mean of the row averages. State per [O, I] matrix: O + I numbers instead of
Adam's 2 O I — for our stacked expert weights [E, D, H], E (D + H) instead of 2 E D H.

Why not transformers' Adafactor (beta1=None, relative_step=False, scale_parameter=False): it differs from
App. D (beta2 follows 1 - t^-0.8 instead of a fixed beta2, updates are clipped by their RMS, no bias
correction), and DeepSpeed takes one optimizer, so it cannot be Adam for the dense groups. Neither it nor
this optimizer can factor under ZeRO-1/2 or DeepSpeed's bf16/fp16 optimizers: those flatten every group
into 1-D partitions, and the matrix shape is gone; `check_optimizer_fits` (layout/checks.py) refuses those
configs.

Under --etp-size T an expert matrix's rows (its hidden units) are split over T ranks (`ROWS_SPLIT_OVER`: the
parameter's attribute naming their group, moe/experts/ffn.py): each rank keeps its rows' averages, and the column
averages and the mean of the row averages, which cover every row, are averaged over the T ranks in one all-reduce
per chunk, so every shard steps as the whole matrix would (`SAME_ON_EVERY_SHARD`: the state that is then the same
on every rank).

Legend (docs/shapes.md): O a matrix's rows, I its columns (the last two dims); leading dims (experts)
are batch dims.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moe_scale.distributed.comm import world_size
from moe_scale.models.vocab_parallel import ROW_SPLIT_TABLE
from moe_scale.moe.experts.ffn import ROWS_SPLIT_OVER

SAME_ON_EVERY_SHARD = ("col",)   # the factored state entries that cover every row: whole on each shard's rank


class FactoredExpertAdam(torch.optim.Optimizer):
    """AdamW on groups without `factored`; App. D's factored, first-moment-free Adam on groups with
    `factored=True` (tensors of 2 or more dims; 1-D tensors there get an unfactored second moment), but for the
    rows of a vocabulary table split over the processes, which share the experts' group (AdamW)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, factored=False))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                t = state["step"]
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                g = p.grad.to(torch.promote_types(p.grad.dtype, torch.float32))   # state in fp32 or wider
                if group["factored"] and getattr(p, ROW_SPLIT_TABLE, False):   # (rows of a vocabulary table:
                    update = _adam_update(g, state, beta1, beta2, t, group["eps"])   # AdamW, as whole)
                    p.add_(update.to(p.dtype), alpha=-group["lr"])
                    continue
                if group["factored"] and g.dim() >= 2:
                    _factored_step_(p, g, state, beta2, t, group["eps"], group["lr"], getattr(p, ROWS_SPLIT_OVER, None))
                    continue
                if group["factored"]:
                    update = _unfactored_update(g, state, beta2, t, group["eps"])
                else:
                    update = _adam_update(g, state, beta1, beta2, t, group["eps"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])
        return loss


def _adam_update(g: torch.Tensor, state: dict, beta1: float, beta2: float, t: int, eps: float) -> torch.Tensor:
    if "exp_avg" not in state:
        state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(g), torch.zeros_like(g)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    m_hat, v_hat = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
    return m_hat / (v_hat.sqrt() + eps)


def _unfactored_update(g: torch.Tensor, state: dict, beta2: float, t: int, eps: float) -> torch.Tensor:
    """1-D tensors in a factored group: nothing to factor, so beta1 = 0 Adam."""
    if "exp_avg_sq" not in state:
        state["exp_avg_sq"] = torch.zeros_like(g)
    v = state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
    return g / ((v / (1 - beta2 ** t)).sqrt() + eps)


CHUNK_ELEMENTS = 1 << 22   # temporaries per chunk of experts: a few x 16 MB in fp32, whatever E is


def _factored_step_(p: torch.Tensor, g: torch.Tensor, state: dict, beta2: float, t: int, eps: float,
                    lr: float, rows_split_over=None) -> None:
    """p -= lr * g / (sqrt(v_hat) + eps), v_hat = (row ⊗ col / mean(row)) / (1 - beta2^t), in place and a
    chunk of leading (expert) indices at a time, so the full-size temporaries (g^2, v_hat) stay small.
    `rows_split_over`: the group over whose ranks the rows are split in equal shares (None: all here)."""
    shards = 1 if rows_split_over is None else world_size(rows_split_over)
    if "row" not in state:
        state["row"] = torch.zeros(g.shape[:-1], dtype=g.dtype, device=g.device)                  # [..., R]
        state["col"] = torch.zeros(g.shape[:-2] + g.shape[-1:], dtype=g.dtype, device=g.device)   # [..., C]
    g_3, p_3 = g.reshape(-1, *g.shape[-2:]), p.view(-1, *p.shape[-2:])     # [L, R, C], L leading matrices
    row_2, col_2 = state["row"].view(-1, g.shape[-2]), state["col"].view(-1, g.shape[-1])
    per_chunk = max(1, CHUNK_ELEMENTS // (g.shape[-2] * g.shape[-1]))
    for lo in range(0, g_3.shape[0], per_chunk):
        chunk = slice(lo, lo + per_chunk)
        g2 = g_3[chunk] * g_3[chunk]
        row = row_2[chunk].mul_(beta2).add_(g2.mean(-1), alpha=1 - beta2)
        if shards == 1:
            col = col_2[chunk].mul_(beta2).add_(g2.mean(-2), alpha=1 - beta2)
            row_mean = row.mean(-1, keepdim=True)
        else:   # means over every row: the shards' (equal-sized) means averaged
            means = torch.cat([g2.mean(-2), row.mean(-1, keepdim=True)], dim=-1)
            dist.all_reduce(means, group=rows_split_over)
            means.div_(shards)
            col = col_2[chunk].mul_(beta2).add_(means[:, :-1], alpha=1 - beta2)
            row_mean = means[:, -1:]
        # the bias correction of row and col cancels in row / mean(row) once; one factor remains
        row_mean = row_mean.clamp_min(1e-30)
        v_hat = torch.mul((row / row_mean).unsqueeze(-1), col.unsqueeze(-2), out=g2).div_(1 - beta2 ** t)
        denominator = v_hat.sqrt_().add_(eps)
        p_3[chunk].addcdiv_(g_3[chunk].to(p.dtype), denominator.to(p.dtype), value=-lr)


def build_optimizer(groups: list[dict[str, Any]], train) -> torch.optim.Optimizer:
    """The --optimizer for DeepSpeed's param groups (expert groups carry `moe=True`)."""
    if train.optimizer == "adam":
        # fused: one multi-threaded pass over each tensor (CPU and CUDA): 222M expert parameters step in 0.17 s
        # instead of 1.5 s (the per-tensor default) on a 2-core CPU, which made big sparse models optimizer-bound
        return torch.optim.AdamW(groups, lr=train.lr, weight_decay=train.weight_decay, fused=True)
    groups = [{**group, "factored": bool(group.get("moe"))} for group in groups]
    return FactoredExpertAdam(groups, lr=train.lr, betas=(0.9, 0.999), weight_decay=train.weight_decay)


def optimizer_state_numel(optimizer: torch.optim.Optimizer, factored_only: bool | None = None) -> int:
    """Numbers held in optimizer state (step counters excluded); restrict to factored / unfactored groups."""
    total = 0
    for group in optimizer.param_groups:
        if factored_only is not None and bool(group.get("factored")) != factored_only:
            continue
        for p in group["params"]:
            total += sum(v.numel() for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return total
