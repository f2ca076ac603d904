"""SwiGLU experts (Shazeer 2020; Mixtral's and Llama's FFN) as one grouped computation, beside the ReLU ones.

Legend (docs/shapes.md): M (token, expert) pairs that arrived at this rank (sorted by local expert), R rows
they read, D model width, F expert hidden width, L local experts.

Pair m (of expert e, reading row r = row_of_pair[m] of `rows`, with gate g_m):

    [a_m, b_m] = rows[r] @ w_in[e].T          w_in [L, 2F, D]: rows 0..F-1 Mixtral's w1 (gate), F..2F-1 its w3 (up)
    y_m        = (silu(a_m) * b_m) @ w_out[e] * scale * g_m          w_out [L, F, D]: Mixtral's w2, transposed

returned per pair ([M, D]) without `row_of_pair`, or summed per row ([R, D]) with it, as moe/experts/ffn.py's
ReLU function returns its own (same arguments, same gate gradient trick: dL/dg_m = scale · <G_m @ w_out[e].T,
hidden_m>). The gate and up matrices are one stacked weight, so the first layer is one grouped product of
width 2F (transformers 5 stores Mixtral's experts the same way: `gate_up_proj`), and every product is a grouped
GEMM of moe/experts/grouped_gemm.py: no per-expert Python loop on any kernel but the `loop` fallback. Saved for
the backward: the rows, the first layer's output [M, 2F] (none with recompute), indices and gates; the
output gradient is read through `row_of_pair` (never gathered into an [M, D] copy).
"""

from __future__ import annotations

import torch

from moe_scale.moe.experts.grouped_gemm import (Counts, GroupLayout, gate_gradient, gated_rows, pair_coefficients,
                                                per_expert_outer, row_dot, rows_times_expert)


def _hidden(gate_up_M2F: torch.Tensor) -> torch.Tensor:
    a_MF, b_MF = gate_up_M2F.chunk(2, dim=1)
    return torch.nn.functional.silu(a_MF) * b_MF


class _SwiGLUExpertFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_RD, w_in_L2FD, w_out_LFD, counts: Counts, row_of_pair_M, gate_M, scale: float,
                recompute: bool, kernel: str | None, grad_buffers):
        layout = GroupLayout(counts, rows_RD, kernel)
        gate_up_M2F = rows_times_expert(rows_RD, w_in_L2FD.transpose(1, 2), layout, row_of_pair_M)
        y_MD = rows_times_expert(_hidden(gate_up_M2F), w_out_LFD, layout)
        coef_M = pair_coefficients(gate_M, scale, y_MD)
        ctx.save_for_backward(rows_RD, w_in_L2FD, w_out_LFD, row_of_pair_M, coef_M,
                              None if recompute else gate_up_M2F)
        ctx.layout, ctx.scale, ctx.gate_dtype = layout, scale, None if gate_M is None else gate_M.dtype
        ctx.grad_buffers = grad_buffers if layout.kernel == "native" else None
        return gated_rows(y_MD, coef_M, row_of_pair_M, rows_RD.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        rows_RD, w_in, w_out, row_of_pair_M, coef_M, gate_up_M2F = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        need_rows, need_w_in, need_w_out = ctx.needs_input_grad[:3]
        need_gate = ctx.needs_input_grad[5]
        if gate_up_M2F is None:   # recompute: the first layer's output was not kept
            gate_up_M2F = rows_times_expert(rows_RD, w_in.transpose(1, 2), layout, row_of_pair_M)
        grad_out = grad_out.contiguous()
        a_MF, b_MF = gate_up_M2F.chunk(2, dim=1)
        silu_a_MF = torch.nn.functional.silu(a_MF)
        hidden_MF = silu_a_MF * b_MF
        coef_M = coef_M.to(grad_out.dtype)
        # G_m @ w_out[e].T per pair, G_m read through row_of_pair (per unit of coef)
        grad_hidden_MF = rows_times_expert(grad_out, w_out.transpose(1, 2), layout, row_of_pair_M)
        grad_gate = grad_rows = grad_w_in = grad_w_out = None
        if need_gate:
            grad_gate = gate_gradient(row_dot(grad_hidden_MF, hidden_MF), scale, ctx.gate_dtype)
        grad_hidden_MF.mul_(coef_M[:, None])
        if need_w_out:   # sum over pairs of (coef_m hidden_m)ᵀ G_m: the hidden side is scaled, G is read in place
            grad_w_out = per_expert_outer(hidden_MF.mul_(coef_M[:, None]), grad_out, layout,
                                          _buffer(ctx, "w_out", w_out), row_of_pair_M)
        del hidden_MF
        sigmoid_a_MF = torch.sigmoid(a_MF)
        grad_gate_up_M2F = torch.cat([grad_hidden_MF * b_MF * sigmoid_a_MF * (1 + a_MF * (1 - sigmoid_a_MF)),
                                      grad_hidden_MF * silu_a_MF], dim=1)
        del grad_hidden_MF, silu_a_MF, sigmoid_a_MF, gate_up_M2F, a_MF, b_MF
        if need_w_in:
            grad_w_in = per_expert_outer(grad_gate_up_M2F, rows_RD, layout, _buffer(ctx, "w_in", w_in),
                                         row_of_pair_M)
        if need_rows:
            grad_x_MD = rows_times_expert(grad_gate_up_M2F, w_in, layout)
            grad_rows = grad_x_MD if row_of_pair_M is None else \
                grad_x_MD.new_zeros(rows_RD.shape).index_add_(0, row_of_pair_M, grad_x_MD)
        return grad_rows, grad_w_in, grad_w_out, None, None, grad_gate, None, None, None, None


def _buffer(ctx, name: str, weight: torch.Tensor):
    return None if ctx.grad_buffers is None else ctx.grad_buffers.take(name, weight)


def swiglu_expert_ffn(rows_RD, w_in_L2FD, w_out_LFD, tokens_per_expert: Counts, row_of_pair_M=None, gate_M=None,
                      scale: float = 1.0, recompute: bool = False, kernel: str | None = None,
                      grad_buffers=None) -> torch.Tensor:
    """See the module docstring; the arguments are moe/experts/ffn.py's `expert_ffn`'s."""
    return _SwiGLUExpertFFN.apply(rows_RD, w_in_L2FD, w_out_LFD, tokens_per_expert, row_of_pair_M, gate_M, scale,
                                  recompute, kernel, grad_buffers)
