"""Experts: one-hidden-layer ReLU FFNs stored as stacked weights, run as one grouped computation.

Legend: M tokens that arrived at this rank (sorted by local expert), D model dim, H expert hidden dim,
E local experts. `tokens_per_expert` lists how many of the M rows belong to each local expert, in order.

Why a custom autograd function: indexing `w[e]` in a Python loop makes autograd materialise a full-size
gradient of `w` per expert (O(E^2) memory traffic; 27 s instead of 0.3 s at 256 experts). Here the backward
writes each expert's gradient straight into one [E, ...] buffer, and experts with no tokens cost a zero
fill. The whole FFN is one function, so `recompute` (Shazeer et al. App. D) simply saves the inputs instead
of the hidden activations and redoes the first matmul in the backward.

The per-expert matmuls use torch's grouped GEMM (`F.grouped_mm`: one call for all experts) where it is
available and tested here (CPU, float32/bfloat16/float16), and a loop over experts otherwise (float64, and
CUDA until the grouped path is validated on a GPU); tests check both give the same result.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """[M, K] @ [G, K, N] (rows split by offsets) or [K, M] @ [M, N] -> [G, K, N] (reduction split): either
    way each element of `a` is multiplied with one row of N values of `b`, so 2 * |a| * N FLOPs."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


if hasattr(torch.ops.aten, "_grouped_mm"):   # so FlopCounterMode counts the experts (torch has no formula yet)
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    if torch.ops.aten._grouped_mm.default not in flop_registry:
        register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


def _use_grouped_mm(t: torch.Tensor) -> bool:
    return hasattr(F, "grouped_mm") and t.device.type == "cpu" and t.dtype in _GROUPED_MM_DTYPES


def _group_ends(counts: list[int], device: torch.device) -> torch.Tensor:
    """Cumulative row counts: the `offs` grouped GEMM takes (also carried to the backward by the loop path)."""
    return torch.tensor(counts, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


def rows_times_expert(a_MI: torch.Tensor, b_EIO: torch.Tensor, counts: list[int], offsets: torch.Tensor,
                      grouped: bool) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ b[e]: [M, O]."""
    if grouped:
        return F.grouped_mm(a_MI, b_EIO, offs=offsets)
    out_MO = a_MI.new_empty(a_MI.shape[0], b_EIO.shape[2])
    start = 0
    for e, count in enumerate(counts):
        if count:
            torch.mm(a_MI[start:start + count], b_EIO[e], out=out_MO[start:start + count])
            start += count
    return out_MO


def per_expert_outer(a_MI: torch.Tensor, b_MO: torch.Tensor, counts: list[int], offsets: torch.Tensor,
                     grouped: bool) -> torch.Tensor:
    """out[e] = a[rows of e].T @ b[rows of e]: [E, I, O], exact zeros for an expert with no rows."""
    if grouped:
        return F.grouped_mm(a_MI.t(), b_MO, offs=offsets)
    out_EIO = a_MI.new_empty(len(counts), a_MI.shape[1], b_MO.shape[1])
    start = 0
    for e, count in enumerate(counts):
        if count:
            torch.mm(a_MI[start:start + count].t(), b_MO[start:start + count], out=out_EIO[e])
            start += count
        else:
            out_EIO[e].zero_()
    return out_EIO


class _GroupedMatmul(torch.autograd.Function):
    """out[rows of e] = x[rows of e] @ w[e] for each expert e (MoA's per-expert W_q and W_o)."""

    @staticmethod
    def forward(ctx, x_MI, w_EIO, counts: list[int]):
        grouped = _use_grouped_mm(x_MI)
        offsets = _group_ends(counts, x_MI.device)
        ctx.save_for_backward(x_MI, w_EIO, offsets)
        ctx.counts, ctx.grouped = counts, grouped
        return rows_times_expert(x_MI, w_EIO, counts, offsets, grouped)

    @staticmethod
    def backward(ctx, grad_MO):
        x_MI, w_EIO, offsets = ctx.saved_tensors
        grad_MO = grad_MO.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = rows_times_expert(grad_MO, w_EIO.transpose(1, 2), ctx.counts, offsets, ctx.grouped)
        if ctx.needs_input_grad[1]:
            grad_w = per_expert_outer(x_MI, grad_MO, ctx.counts, offsets, ctx.grouped)
        return grad_x, grad_w, None


def grouped_matmul(x_MI: torch.Tensor, w_EIO: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
    return _GroupedMatmul.apply(x_MI, w_EIO, tokens_per_expert)


class _ExpertFFN(torch.autograd.Function):
    """y[rows of e] = relu(x[rows of e] @ w_in[e]) @ w_out[e] * scale for every local expert e."""

    @staticmethod
    def forward(ctx, x_MD, w_in_EDH, w_out_EHD, counts: list[int], scale: float, recompute: bool):
        grouped = _use_grouped_mm(x_MD)
        offsets = _group_ends(counts, x_MD.device)
        hidden_MH = rows_times_expert(x_MD, w_in_EDH, counts, offsets, grouped).relu_()
        y_MD = rows_times_expert(hidden_MH, w_out_EHD, counts, offsets, grouped).mul_(scale)
        ctx.save_for_backward(x_MD, w_in_EDH, w_out_EHD, offsets, None if recompute else hidden_MH)
        ctx.counts, ctx.scale, ctx.grouped = counts, scale, grouped
        return y_MD

    @staticmethod
    def backward(ctx, grad_y_MD):
        x_MD, w_in, w_out, offsets, hidden_MH = ctx.saved_tensors
        counts, grouped = ctx.counts, ctx.grouped
        if hidden_MH is None:   # recompute: the hidden layer was not kept
            hidden_MH = rows_times_expert(x_MD, w_in, counts, offsets, grouped).relu_()
        grad_y_MD = (grad_y_MD * ctx.scale).contiguous()
        need_x, need_w_in, need_w_out = ctx.needs_input_grad[:3]
        grad_w_out = per_expert_outer(hidden_MH, grad_y_MD, counts, offsets, grouped) if need_w_out else None
        grad_x = grad_w_in = None
        if need_x or need_w_in:
            grad_hidden_MH = rows_times_expert(grad_y_MD, w_out.transpose(1, 2), counts, offsets, grouped)
            grad_hidden_MH.mul_(hidden_MH > 0)   # ReLU: hidden > 0 exactly where its input was
            if need_w_in:
                grad_w_in = per_expert_outer(x_MD, grad_hidden_MH, counts, offsets, grouped)
            if need_x:
                grad_x = rows_times_expert(grad_hidden_MH, w_in.transpose(1, 2), counts, offsets, grouped)
        return grad_x, grad_w_in, grad_w_out, None, None, None


def expert_ffn(x_MD, w_in_EDH, w_out_EHD, tokens_per_expert: list[int], scale: float = 1.0,
               recompute: bool = False) -> torch.Tensor:
    return _ExpertFFN.apply(x_MD, w_in_EDH, w_out_EHD, tokens_per_expert, scale, recompute)


class GroupedExperts(nn.Module):
    """E local experts, each D -> H (ReLU) -> D with no biases (t2t's `ffn_expert_fn`).

    The output is scaled by sqrt(D/H) (t2t's autoscale) so expert outputs keep unit scale whatever H is.
    Weights are Glorot-uniform per expert matrix, as t2t's default initializer, drawn from a generator
    seeded by (seed, global expert id): an expert starts the same whichever rank holds it, so runs with
    different --ep-size start from the same model, and the global RNG is left untouched.
    """

    def __init__(self, num_local_experts: int, d_model: int, d_hidden: int, first_global_expert: int = 0,
                 seed: int = 0, recompute: bool = False):
        super().__init__()
        self.recompute = recompute
        self.num_local_experts, self.d_model, self.d_hidden = num_local_experts, d_model, d_hidden
        self.first_global_expert, self.seed = first_global_expert, seed
        self.w_in = nn.Parameter(torch.empty(num_local_experts, d_model, d_hidden))
        self.w_out = nn.Parameter(torch.empty(num_local_experts, d_hidden, d_model))
        self.output_scale = math.sqrt(d_model / d_hidden)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.w_in.is_meta:   # shapes only (moe-scale flops / plan): nothing to draw
            return
        bound = math.sqrt(6.0 / (self.d_model + self.d_hidden))
        with torch.no_grad():
            for local_id in range(self.num_local_experts):
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first_global_expert + local_id)
                for weight in (self.w_in, self.w_out):
                    init = torch.empty(weight.shape[1:]).uniform_(-bound, bound, generator=generator)
                    weight[local_id].copy_(init)

    def forward(self, tokens_MD: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        w_in, w_out = self.w_in, self.w_out
        device_type = tokens_MD.device.type
        if torch.is_autocast_enabled(device_type):  # autocast skips custom Functions: cast as it would for a matmul
            dtype = torch.get_autocast_dtype(device_type)
            tokens_MD, w_in, w_out = tokens_MD.to(dtype), w_in.to(dtype), w_out.to(dtype)
        return expert_ffn(tokens_MD, w_in, w_out, tokens_per_expert, self.output_scale, self.recompute)
