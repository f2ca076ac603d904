"""Experts: one-hidden-layer ReLU FFNs stored as stacked weights, run as one grouped computation.

Legend: M tokens that arrived at this rank (sorted by local expert), D model dim, H expert hidden dim,
E local experts. `tokens_per_expert` lists how many of the M rows belong to each local expert, in order.

Why a custom autograd function: indexing `w[e]` in a Python loop makes autograd materialise a full-size
gradient of `w` per expert (O(E^2) memory traffic; 27 s instead of 0.3 s at 256 experts). Here the backward
writes each expert's gradient straight into one [E, ...] buffer, and experts with no tokens cost a zero
fill. The whole FFN is one function, so `recompute` (Shazeer et al. App. D) simply saves the inputs instead
of the hidden activations and redoes the first matmul in the backward.

Each per-expert product runs as one call for all experts: a zero-padded batched GEMM where few rows are
padded, torch's grouped GEMM (`F.grouped_mm`, CPU float32/bfloat16/float16) otherwise, and a loop over experts
where neither applies; `GroupLayout` picks per product, and tests check all three give the same result.
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


def _grouped_mm_available(t: torch.Tensor) -> bool:
    return hasattr(F, "grouped_mm") and t.device.type == "cpu" and t.dtype in _GROUPED_MM_DTYPES


# The padded kernel multiplies zeros in the padding: free while the product stays bound by the expert weights'
# memory traffic (about 2 * peak FLOP/s / bandwidth ~ 25 rows per expert on CPUs and GPUs alike), or while the
# padding at most doubles the rows.
_PADDED_OUTER_MAX_ROWS = 32
_PADDED_MAX_GROWTH = 2

KERNELS = ("loop", "grouped", "padded")


class GroupLayout:
    """M rows sorted by expert, `counts[e]` of them for expert e, and the kernel each per-expert product uses.

    Kernels:
      loop     one torch.mm per expert (the reference; the fallback where grouped GEMM is not available)
      grouped  torch's grouped GEMM over the row offsets (CPU float32/bfloat16/float16)
      padded   rows scattered into a zero-padded [E, P, ...] batch (P = the largest count), one torch.bmm

    Measured here (2048 tokens x k, D=256, H=512, 2 threads): the weight-gradient products x[rows of e].T @ g
    have only M/E rows of reduction, and one bmm over the padded batch writes them 1.3-1.9x faster than the
    grouped GEMM at every E, so `outer_kernel` is padded unless one expert holds far more rows than the rest.
    The row products (forward and input gradient) gain from padding only while it adds few rows: at E=4096,
    the grouped GEMM skips the experts with no rows, and the padded bmm would read all of their weights.
    """

    def __init__(self, counts: list[int], like: torch.Tensor, kernel: str | None = None):
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.counts = counts
        self._counts_E = torch.tensor(counts, dtype=torch.long, device=like.device)
        self.offsets = self._counts_E.cumsum(0, dtype=torch.int32)
        self.num_rows, self.num_groups = sum(counts), len(counts)
        self.pad_rows = max(counts, default=0)
        fallback = "grouped" if _grouped_mm_available(like) else "loop"
        few_padded = self.num_rows > 0 and self.num_groups * self.pad_rows <= _PADDED_MAX_GROWTH * self.num_rows
        short_groups = self.num_rows > 0 and self.pad_rows <= _PADDED_OUTER_MAX_ROWS
        self.matmul_kernel = kernel or ("padded" if few_padded else fallback)
        self.outer_kernel = kernel or ("padded" if few_padded or short_groups else fallback)
        if self.num_rows == 0 and kernel == "padded":
            self.matmul_kernel = self.outer_kernel = fallback   # nothing to pad
        self._slot_M = None

    def slot_M(self) -> torch.Tensor:
        """Row m, the j-th row of expert e, sits at e * P + j of the padded batch."""
        if self._slot_M is None:
            device = self.offsets.device
            expert_M = torch.repeat_interleave(torch.arange(self.num_groups, device=device), self._counts_E)
            first_row_E = self.offsets.long() - self._counts_E
            self._slot_M = (expert_M * self.pad_rows + torch.arange(self.num_rows, device=device)
                            - first_row_E.index_select(0, expert_M))
        return self._slot_M

    def pad(self, a_MI: torch.Tensor) -> torch.Tensor:
        """[M, I] -> [E, P, I], zeros where an expert has fewer than P rows."""
        padded = a_MI.new_zeros(self.num_groups * self.pad_rows, a_MI.shape[1])
        return padded.index_copy_(0, self.slot_M(), a_MI).view(self.num_groups, self.pad_rows, -1)

    def unpad(self, a_EPO: torch.Tensor) -> torch.Tensor:
        return a_EPO.reshape(-1, a_EPO.shape[2]).index_select(0, self.slot_M())


def rows_times_expert(a_MI: torch.Tensor, b_EIO: torch.Tensor, layout: GroupLayout,
                      kernel: str | None = None) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ b[e]: [M, O]."""
    kernel = kernel or layout.matmul_kernel
    if kernel == "padded":
        return layout.unpad(torch.bmm(layout.pad(a_MI), b_EIO))
    if kernel == "grouped":
        return F.grouped_mm(a_MI, b_EIO, offs=layout.offsets)
    out_MO = a_MI.new_empty(a_MI.shape[0], b_EIO.shape[2])
    start = 0
    for e, count in enumerate(layout.counts):
        if count:
            torch.mm(a_MI[start:start + count], b_EIO[e], out=out_MO[start:start + count])
            start += count
    return out_MO


def per_expert_outer(a_MI: torch.Tensor, b_MO: torch.Tensor, layout: GroupLayout,
                     kernel: str | None = None) -> torch.Tensor:
    """out[e] = a[rows of e].T @ b[rows of e]: [E, I, O], exact zeros for an expert with no rows."""
    kernel = kernel or layout.outer_kernel
    if kernel == "padded":
        return torch.bmm(layout.pad(a_MI).transpose(1, 2), layout.pad(b_MO))
    if kernel == "grouped":
        return F.grouped_mm(a_MI.t(), b_MO, offs=layout.offsets)
    out_EIO = a_MI.new_empty(layout.num_groups, a_MI.shape[1], b_MO.shape[1])
    start = 0
    for e, count in enumerate(layout.counts):
        if count:
            torch.mm(a_MI[start:start + count].t(), b_MO[start:start + count], out=out_EIO[e])
            start += count
        else:
            out_EIO[e].zero_()
    return out_EIO


class _GroupedMatmul(torch.autograd.Function):
    """out[rows of e] = x[rows of e] @ w[e] for each expert e (MoA's per-expert W_q and W_o)."""

    @staticmethod
    def forward(ctx, x_MI, w_EIO, counts: list[int], kernel: str | None):
        layout = GroupLayout(counts, x_MI, kernel)
        ctx.save_for_backward(x_MI, w_EIO)
        ctx.layout = layout
        return rows_times_expert(x_MI, w_EIO, layout)

    @staticmethod
    def backward(ctx, grad_MO):
        x_MI, w_EIO = ctx.saved_tensors
        grad_MO = grad_MO.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = rows_times_expert(grad_MO, w_EIO.transpose(1, 2), ctx.layout)
        if ctx.needs_input_grad[1]:
            grad_w = per_expert_outer(x_MI, grad_MO, ctx.layout)
        return grad_x, grad_w, None, None


def grouped_matmul(x_MI: torch.Tensor, w_EIO: torch.Tensor, tokens_per_expert: list[int],
                   kernel: str | None = None) -> torch.Tensor:
    return _GroupedMatmul.apply(x_MI, w_EIO, tokens_per_expert, kernel)


class _ExpertFFN(torch.autograd.Function):
    """y[rows of e] = relu(x[rows of e] @ w_in[e]) @ w_out[e] * scale for every local expert e.

    When the row products are padded, forward and backward each pad their inputs once and stay in the padded
    [E, P, ...] batch throughout; the hidden layer is saved unpadded, so the padding never outlives a pass."""

    @staticmethod
    def forward(ctx, x_MD, w_in_EDH, w_out_EHD, counts: list[int], scale: float, recompute: bool,
                kernel: str | None):
        layout = GroupLayout(counts, x_MD, kernel)
        if layout.matmul_kernel == "padded":
            hidden_EPH = torch.bmm(layout.pad(x_MD), w_in_EDH).relu_()
            y_MD = layout.unpad(torch.bmm(hidden_EPH, w_out_EHD)).mul_(scale)
            hidden_MH = None if recompute else layout.unpad(hidden_EPH)
        else:
            hidden_MH = rows_times_expert(x_MD, w_in_EDH, layout).relu_()
            y_MD = rows_times_expert(hidden_MH, w_out_EHD, layout).mul_(scale)
        ctx.save_for_backward(x_MD, w_in_EDH, w_out_EHD, None if recompute else hidden_MH)
        ctx.layout, ctx.scale = layout, scale
        return y_MD

    @staticmethod
    def backward(ctx, grad_y_MD):
        x_MD, w_in, w_out, hidden_MH = ctx.saved_tensors
        layout = ctx.layout
        grad_y_MD = (grad_y_MD * ctx.scale).contiguous()
        if layout.matmul_kernel == "padded":
            grads = _ffn_backward_padded(layout, x_MD, w_in, w_out, hidden_MH, grad_y_MD, ctx.needs_input_grad)
        else:
            grads = _ffn_backward_rows(layout, x_MD, w_in, w_out, hidden_MH, grad_y_MD, ctx.needs_input_grad)
        return (*grads, None, None, None, None)


def _ffn_backward_rows(layout, x_MD, w_in, w_out, hidden_MH, grad_y_MD, needs_input_grad):
    if hidden_MH is None:   # recompute: the hidden layer was not kept
        hidden_MH = rows_times_expert(x_MD, w_in, layout).relu_()
    need_x, need_w_in, need_w_out = needs_input_grad[:3]
    grad_w_out = per_expert_outer(hidden_MH, grad_y_MD, layout) if need_w_out else None
    grad_x = grad_w_in = None
    if need_x or need_w_in:
        grad_hidden_MH = rows_times_expert(grad_y_MD, w_out.transpose(1, 2), layout)
        grad_hidden_MH.mul_(hidden_MH > 0)   # ReLU: hidden > 0 exactly where its input was
        if need_w_in:
            grad_w_in = per_expert_outer(x_MD, grad_hidden_MH, layout)
        if need_x:
            grad_x = rows_times_expert(grad_hidden_MH, w_in.transpose(1, 2), layout)
    return grad_x, grad_w_in, grad_w_out


def _ffn_backward_padded(layout, x_MD, w_in, w_out, hidden_MH, grad_y_MD, needs_input_grad):
    x_EPD = layout.pad(x_MD)
    hidden_EPH = torch.bmm(x_EPD, w_in).relu_() if hidden_MH is None else layout.pad(hidden_MH)
    grad_y_EPD = layout.pad(grad_y_MD)
    need_x, need_w_in, need_w_out = needs_input_grad[:3]
    grad_w_out = torch.bmm(hidden_EPH.transpose(1, 2), grad_y_EPD) if need_w_out else None
    grad_x = grad_w_in = None
    if need_x or need_w_in:
        grad_hidden_EPH = torch.bmm(grad_y_EPD, w_out.transpose(1, 2)).mul_(hidden_EPH > 0)
        if need_w_in:
            grad_w_in = torch.bmm(x_EPD.transpose(1, 2), grad_hidden_EPH)
        if need_x:
            grad_x = layout.unpad(torch.bmm(grad_hidden_EPH, w_in.transpose(1, 2)))
    return grad_x, grad_w_in, grad_w_out


def expert_ffn(x_MD, w_in_EDH, w_out_EHD, tokens_per_expert: list[int], scale: float = 1.0,
               recompute: bool = False, kernel: str | None = None) -> torch.Tensor:
    """`kernel` forces one kernel for every product (tests); by default GroupLayout picks per product."""
    return _ExpertFFN.apply(x_MD, w_in_EDH, w_out_EHD, tokens_per_expert, scale, recompute, kernel)


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
