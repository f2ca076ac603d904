"""Experts: one-hidden-layer FFNs of one kind (moe/experts/kinds.py: ReLU, SwiGLU, GeGLU) stored as stacked
weights, run as one grouped computation.

Legend (docs/shapes.md): M (token, expert) pairs that arrived at this rank (sorted by local expert), R rows
they read, D model width, F expert hidden width, X the first layer's width (F, or 2F for a gated kind), L local
experts, I input width, O output width (of a product).

`tokens_per_expert` says how many of the M rows belong to each local expert, in order: a device tensor (with the
same counts as a host list beside it where the caller read them anyway), or a list.

Why a custom autograd function: indexing `w[e]` in a Python loop makes autograd materialise a full-size
gradient of `w` per expert (O(E^2) memory traffic). Here the backward
writes each expert's gradient straight into one [L, ...] buffer, and experts with no tokens cost a zero
fill. The whole FFN is one function, so `recompute` (Shazeer et al. App. D) simply saves the inputs instead
of the hidden activations and redoes the first matmul in the backward.

Each per-expert product is one grouped GEMM for all experts (moe/experts/grouped_gemm.py picks the kernel: the
native CPU kernels for float32 on CPU, which also gather each pair's input row while reading it and apply
the ReLU as they store; torch's or DeepSpeed's grouped GEMMs elsewhere), so the number of kernels a step
launches does not depend on the number of experts.
"""

from __future__ import annotations


import torch
from torch import nn

from moe_scale.moe.experts.grouped_gemm import (Counts, GroupLayout, gated_rows, pair_coefficients, per_expert_outer,
                                                rows_times_expert)
from moe_scale.moe.experts.kinds import ExpertKind, expert_kind, hidden_rows


class _GroupedMatmul(torch.autograd.Function):
    """out[rows of e] = x[rows of e] @ w[e] for each expert e (MoA's per-expert W_q and W_o)."""

    @staticmethod
    def forward(ctx, x_MI, w_LIO, counts: Counts, kernel: str | None):
        layout = GroupLayout(counts, x_MI, kernel)
        ctx.save_for_backward(x_MI, w_LIO)
        ctx.layout = layout
        return rows_times_expert(x_MI, w_LIO, layout)

    @staticmethod
    def backward(ctx, grad_MO):
        x_MI, w_LIO = ctx.saved_tensors
        grad_MO = grad_MO.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = rows_times_expert(grad_MO, w_LIO.transpose(1, 2), ctx.layout)
        if ctx.needs_input_grad[1]:
            grad_w = per_expert_outer(x_MI, grad_MO, ctx.layout)
        return grad_x, grad_w, None, None


def grouped_matmul(x_MI: torch.Tensor, w_LIO: torch.Tensor, tokens_per_expert: Counts,
                   kernel: str | None = None) -> torch.Tensor:
    return _GroupedMatmul.apply(x_MI, w_LIO, tokens_per_expert, kernel)


class GradientBuffers:
    """Lets each expert weight's gradient be written into the memory of its previous one, on CPU.

    torch's CPU allocator hands large blocks back to the system when they are freed, so every step's
    [L, F, D] gradients land on fresh pages, which the kernel zero-fills before the first write: several times
    slower than writing into memory written before (docs/performance.md, "Host memory policy"). So the experts
    keep the storage of the last gradient of each weight and hand autograd a new view of it, which
    AccumulateGrad adopts as `.grad` without a copy.
    Only while nothing else holds that storage (the `.grad` was cleared, or DeepSpeed moved it into its own
    buffers): otherwise a fresh buffer is taken, so a gradient still in use is never written over.

    Cost: between steps, one gradient-sized buffer per expert weight stays allocated (what a GPU's caching
    allocator keeps as well). `GroupedExperts(reuse_grad_buffers=False)` / `--no-expert-grad-reuse` turns
    it off.
    """

    def __init__(self):
        self._kept: dict[str, tuple[torch.Tensor, int]] = {}   # name -> (buffer, storage users when free)

    def take(self, name: str, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(a tensor shaped, typed and placed like `like`, to be written over; whether its memory was written
        before): the kept buffer when it is free, else a new one."""
        kept = self._kept.get(name)
        if kept is not None and self._is_free(*kept) and kept[0].shape == like.shape \
                and kept[0].dtype == like.dtype and kept[0].device == like.device:
            return kept[0].view(like.shape), True
        buffer = torch.empty_like(like, memory_format=torch.contiguous_format)
        self._kept[name] = (buffer, _storage_users(buffer))
        return buffer.view(like.shape), False   # a view: a tensor of its own, which AccumulateGrad may adopt

    @staticmethod
    def _is_free(buffer: torch.Tensor, users_when_free: int) -> bool:
        return users_when_free > 0 and _storage_users(buffer) == users_when_free


def _storage_users(t: torch.Tensor) -> int:
    """Tensors sharing t's storage (counted by torch; 0 where this torch cannot tell: never reused)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count(t.untyped_storage()._cdata) if count is not None else 0


class _ExpertFFN(torch.autograd.Function):
    """Pair m (of expert e, reading row r = row_of_pair[m] of `rows`, with gate g_m), for any expert kind
    (moe/experts/kinds.py; ReLU here):
        y_m = relu(rows[r] @ w_in[e].T) @ w_out[e] * scale * g_m
    returned per pair ([M, D]) without `row_of_pair`, or summed per row ([R, D]) with it.

    Gating and summing inside the function keeps memory near a dense FFN's: the pairs' input rows are gathered
    and their outputs scattered here, so neither is saved. Nor is y: with G_m = dL/d(output row of pair m),
    dL/dg_m = scale * <G_m, hidden_m @ w_out[e]> = scale * <G_m @ w_out[e].T, hidden_m>, and G_m @ w_out[e].T
    is a product the backward computes anyway. Saved: the rows, the first layer's output (none with recompute),
    indices and gates. The kind computes the first layer and the activation's backward; the products of the second
    layer's forward, of w_in's gradient and of the rows' are the same for every kind.
    """

    @staticmethod
    def forward(ctx, rows_RD, w_in_LXD, w_out_LFD, counts: Counts, row_of_pair_M, gate_M, scale: float,
                recompute: bool, kernel: str | None, grad_buffers: GradientBuffers | None, kind: ExpertKind):
        layout = GroupLayout(counts, rows_RD, kernel)
        first_MX = kind.first_layer(rows_RD, w_in_LXD, layout, row_of_pair_M)
        y_MD = rows_times_expert(kind.hidden(first_MX), w_out_LFD, layout)
        coef_M = pair_coefficients(gate_M, scale, y_MD)
        ctx.save_for_backward(rows_RD, w_in_LXD, w_out_LFD, row_of_pair_M, coef_M, None if recompute else first_MX)
        ctx.layout, ctx.scale, ctx.gate_dtype, ctx.kind = layout, scale, None if gate_M is None else gate_M.dtype, kind
        # Only the native kernel writes into a given buffer; it runs where fresh pages cost the most.
        ctx.grad_buffers = grad_buffers if layout.kernel == "native" else None
        return gated_rows(y_MD, coef_M, row_of_pair_M, rows_RD.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        rows_RD, w_in, w_out, row_of_pair_M, coef_M, first_MX = ctx.saved_tensors
        layout, kind = ctx.layout, ctx.kind
        need_rows, need_w_in, need_w_out = ctx.needs_input_grad[:3]
        if first_MX is None:   # recompute: the first layer's output was not kept
            first_MX = kind.first_layer(rows_RD, w_in, layout, row_of_pair_M)
        grad_rows = grad_w_in = None
        grad_first_MX, grad_gate, grad_w_out = kind.hidden_backward(
            grad_out, row_of_pair_M, w_out, first_MX, coef_M.to(grad_out.dtype), layout, ctx.scale, ctx.gate_dtype,
            ctx.needs_input_grad[5], need_w_out, _buffer(ctx, "w_out", w_out) if need_w_out else None)
        del first_MX
        if need_w_in:   # the pairs' input rows are read through row_of_pair, not gathered and kept
            grad_w_in = per_expert_outer(grad_first_MX, rows_RD, layout, _buffer(ctx, "w_in", w_in), row_of_pair_M)
        if need_rows:
            grad_x_MD = rows_times_expert(grad_first_MX, w_in, layout)
            del grad_first_MX
            grad_rows = grad_x_MD if row_of_pair_M is None else \
                grad_x_MD.new_zeros(rows_RD.shape).index_add_(0, row_of_pair_M, grad_x_MD)
        return grad_rows, grad_w_in, grad_w_out, None, None, grad_gate, None, None, None, None, None


def _buffer(ctx, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    return None if ctx.grad_buffers is None else ctx.grad_buffers.take(name, weight)


def expert_ffn(rows_RD, w_in_LXD, w_out_LFD, tokens_per_expert: Counts, row_of_pair_M=None, gate_M=None,
               scale: float = 1.0, recompute: bool = False, kernel: str | None = None,
               grad_buffers: GradientBuffers | None = None, kind: str | ExpertKind = "relu") -> torch.Tensor:
    """See _ExpertFFN. `kernel` forces one kernel (tests); by default GroupLayout picks per product.
    `grad_buffers`: where the weight gradients may be written (see GradientBuffers)."""
    return _ExpertFFN.apply(rows_RD, w_in_LXD, w_out_LFD, tokens_per_expert, row_of_pair_M, gate_M, scale,
                            recompute, kernel, grad_buffers, expert_kind(kind))


ROWS_SPLIT_OVER = "rows_split_over"   # an expert weight's attribute: the group its rows are split over (--etp-size)


class GroupedExperts(nn.Module):
    """L local experts of one kind (moe/experts/kinds.py: `activation` names it; ReLU by default, t2t's
    `ffn_expert_fn`: D -> F -> D with no biases, output scaled by sqrt(D/F)), stacked: w_in [L, X, D] (X = F, or 2F
    for a gated kind's gate and up rows), w_out [L, F, D].

    Each expert's weights are drawn by its kind from a generator seeded by (seed, global expert id): an expert
    starts the same whichever rank holds it, so runs with different --ep-size start from the same model, and the
    global RNG is left untouched. The generator is on the device the weights are made on (a GPU's draws other
    numbers than the CPU's for the same seed).

    w_in is stored as nn.Linear stores (out, in): the forward's x @ w_in[e].T and the backward's g @ w_in[e] then
    both take MKL's faster operand layouts for these shapes.
    """

    def __init__(self, num_local_experts: int, d_model: int, d_hidden: int, first_global_expert: int = 0,
                 seed: int = 0, recompute: bool = False, reuse_grad_buffers: bool = True,
                 activation: str | ExpertKind = "relu", shard: int = 0, shards: int = 1):
        """`shard` of `shards` (--etp-size): this rank holds hidden units [shard F / shards, (shard + 1) F / shards)
        of every local expert (the first layer's rows, the second's rows), drawn as the whole expert draws them;
        the output scale is the whole expert's. Summed over the shards, the outputs are the whole expert's."""
        super().__init__()
        if d_hidden % shards:
            raise ValueError(f"an expert's hidden width {d_hidden} does not split into {shards} shards")
        self.kind = expert_kind(activation)
        self.recompute = recompute
        self.grad_buffers = GradientBuffers() if reuse_grad_buffers else None
        self.num_local_experts, self.d_model, self.d_hidden = num_local_experts, d_model, d_hidden // shards
        self.first_global_expert, self.seed, self.shard, self.shards = first_global_expert, seed, shard, shards
        self.w_in = nn.Parameter(torch.empty(num_local_experts, self.kind.first_width(self.d_hidden), d_model))
        self.w_out = nn.Parameter(torch.empty(num_local_experts, self.d_hidden, d_model))
        self.output_scale = self.kind.output_scale(d_model, d_hidden)
        self.reset_parameters()

    @property
    def activation(self) -> str:
        return self.kind.name

    def reset_parameters(self) -> None:
        if self.w_in.is_meta:   # shapes only (moe-scale flops / plan): nothing to draw
            return
        device = self.w_in.device   # built on a GPU (torch.device context): drawn there, never through host memory
        with torch.no_grad():
            for local_id in range(self.num_local_experts):
                generator = torch.Generator(device).manual_seed(
                    self.seed * 1_000_003 + self.first_global_expert + local_id)
                if self.shards == 1:
                    self.kind.init_expert(self.w_in[local_id], self.w_out[local_id], generator)
                    continue
                whole_in = self.w_in.new_empty(self.w_in.shape[1] * self.shards, self.d_model)
                whole_out = self.w_out.new_empty(self.d_hidden * self.shards, self.d_model)
                self.kind.init_expert(whole_in, whole_out, generator)
                self.set_expert(local_id, whole_in, whole_out)

    def split_rows_over(self, group) -> None:
        """--etp-size: both weights' rows (the hidden units) are split over the ranks of `group` (None: one shard);
        what reads a whole matrix's rows (the factored optimizer's column means) asks them."""
        for param in (self.w_in, self.w_out):
            setattr(param, ROWS_SPLIT_OVER, group)

    def set_expert(self, local_id: int, whole_in_XD: torch.Tensor, whole_out_FD: torch.Tensor) -> None:
        """Local expert `local_id` from a whole expert's weights (its first layer [X, D], its second [F, D]): this
        rank's shard of them (--etp-size)."""
        with torch.no_grad():
            self.w_in[local_id].copy_(self.in_shard(whole_in_XD))
            self.w_out[local_id].copy_(self.out_shard(whole_out_FD))

    def in_shard(self, whole_in_XD: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole expert's first layer (a gated kind's gate and up rows alike)."""
        return whole_in_XD if self.shards == 1 else self.kind.hidden_slice(whole_in_XD, self.shard, self.shards)

    def out_shard(self, whole_out_FD: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole expert's second layer."""
        return hidden_rows(whole_out_FD, self.shard, self.shards)

    def forward(self, rows_RD: torch.Tensor, tokens_per_expert: Counts, row_of_pair_M: torch.Tensor | None = None,
                gate_M: torch.Tensor | None = None) -> torch.Tensor:
        """Per pair [M, D] for expert-sorted rows; with `row_of_pair_M` and `gate_M`, the gated sum per row
        [R, D] (see _ExpertFFN)."""
        w_in, w_out = self.w_in, self.w_out
        device_type = rows_RD.device.type
        if torch.is_autocast_enabled(device_type):  # autocast skips custom Functions: cast as it would for a matmul
            dtype = torch.get_autocast_dtype(device_type)
            rows_RD, w_in, w_out = rows_RD.to(dtype), w_in.to(dtype), w_out.to(dtype)
        grad_buffers = self.grad_buffers if w_in is self.w_in else None   # autocast: the casts' gradients
        return expert_ffn(rows_RD, w_in, w_out, tokens_per_expert, row_of_pair_M, gate_M, self.output_scale,
                          self.recompute, grad_buffers=grad_buffers, kind=self.kind)
