"""Experts: one-hidden-layer ReLU FFNs stored as stacked weights, run as one grouped computation.

Legend: M tokens that arrived at this rank (sorted by local expert), D model dim, H expert hidden dim,
E local experts. `tokens_per_expert` lists how many of the M rows belong to each local expert, in order.

Why a custom autograd function: indexing `w[e]` in a Python loop makes autograd materialise a full-size
gradient of `w` per expert (O(E^2) memory traffic; 27 s instead of 0.3 s at 256 experts). Here the backward
writes each expert's gradient straight into one [E, D, H] buffer, and experts with no tokens cost nothing.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class _GroupedMatmul(torch.autograd.Function):
    """out[rows of e] = x[rows of e] @ w[e] for each expert e; rows are contiguous per expert."""

    @staticmethod
    def forward(ctx, x_MI: torch.Tensor, w_EIO: torch.Tensor, tokens_per_expert: list[int]):
        out_MO = x_MI.new_empty(x_MI.shape[0], w_EIO.shape[2])
        start = 0
        for e, count in enumerate(tokens_per_expert):
            if count:
                torch.mm(x_MI[start:start + count], w_EIO[e], out=out_MO[start:start + count])
                start += count
        ctx.save_for_backward(x_MI, w_EIO)
        ctx.tokens_per_expert = tokens_per_expert
        return out_MO

    @staticmethod
    def backward(ctx, grad_MO: torch.Tensor):
        x_MI, w_EIO = ctx.saved_tensors
        grad_MO = grad_MO.contiguous()
        grad_x = x_MI.new_empty(x_MI.shape) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(w_EIO) if ctx.needs_input_grad[1] else None   # every expert written below
        start = 0
        for e, count in enumerate(ctx.tokens_per_expert):
            if not count:
                if grad_w is not None:
                    grad_w[e].zero_()
                continue
            rows = slice(start, start + count)
            if grad_x is not None:
                torch.mm(grad_MO[rows], w_EIO[e].t(), out=grad_x[rows])
            if grad_w is not None:
                torch.mm(x_MI[rows].t(), grad_MO[rows], out=grad_w[e])
            start += count
        return grad_x, grad_w, None


def grouped_matmul(x_MI: torch.Tensor, w_EIO: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
    return _GroupedMatmul.apply(x_MI, w_EIO, tokens_per_expert)


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
        if self.recompute and torch.is_grad_enabled():   # App. D: keep only the inputs, redo the hidden layer
            return checkpoint(self._ffn, tokens_MD, w_in, w_out, tokens_per_expert, use_reentrant=False)
        return self._ffn(tokens_MD, w_in, w_out, tokens_per_expert)

    def _ffn(self, tokens_MD, w_in, w_out, tokens_per_expert: list[int]) -> torch.Tensor:
        hidden_MH = torch.relu(grouped_matmul(tokens_MD, w_in, tokens_per_expert))
        return grouped_matmul(hidden_MH, w_out, tokens_per_expert) * self.output_scale
