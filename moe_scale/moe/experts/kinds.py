"""Expert kinds: what one expert's FFN computes, one class per kind, found by name in EXPERT_KINDS.

Legend (docs/shapes.md): M (token, expert) pairs that arrived at this rank (sorted by local expert), R rows
they read, D model width, F expert hidden width, L local experts, N tokens, X the first layer's width (F, or 2F
for a gated kind: its gate rows then its up rows, stacked).

A kind owns everything that differs between expert FFNs: the first layer's width, the initial weights, the
activation's forward and backward (the middle of moe/experts/ffn.py's one autograd Function, which does the
grouped products every kind shares), the output scale, the multiply-adds and stored values per token the FLOP and
memory accounting count, and the activation's name in transformers (`hf_act`, for a native export). A new kind is
one class here and its line in EXPERT_KINDS:

    relu    D -> F (ReLU) -> D, output scaled by sqrt(D/F), Glorot-uniform weights (Shazeer et al. 2017, t2t's)
    swiglu  D -> F (silu(x W1ᵀ) · x W3ᵀ) -> D, N(0, 0.02²) weights, no scale (Shazeer 2020; Mixtral's)
    geglu   the same with GELU (erf) for silu (Shazeer 2020's GEGLU)

Every kind's weights are drawn per expert from the generator seeded by (seed, global expert id) that the caller
passes, so an expert starts the same whichever rank holds it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moe_scale.moe.cpu_backend import kernels as cpu_kernels
from moe_scale.moe.experts.grouped_gemm import GroupLayout, gate_gradient, per_expert_outer, row_dot, rows_times_expert

GATED_INIT_STD = 0.02   # transformers' initializer_range, with which it initialises Mixtral's experts


class ExpertKind:
    """One expert FFN: w_in [X, D] (nn.Linear's (out, in)), w_out [F, D]."""

    name: str = ""
    hf_act: str | None = None   # transformers' ACT2FN name of the activation; None: no native export
    gated = False               # a gated kind's first layer is the gate and up rows stacked; its dense FFN is 3 linears

    def first_width(self, hidden: int) -> int:
        return 2 * hidden if self.gated else hidden

    def output_scale(self, d_model: int, hidden: int) -> float:
        return 1.0

    def forward_macs(self, d_model: int, hidden: int) -> int:
        """Multiply-adds of one token through one expert."""
        return (self.first_width(hidden) + hidden) * d_model

    def stored_per_hidden(self) -> int:
        """Values per hidden unit a pair keeps for the backward (the accounting's activation memory)."""
        return 1

    def init_expert(self, w_in_XD: torch.Tensor, w_out_FD: torch.Tensor, generator: torch.Generator) -> None:
        raise NotImplementedError

    def hidden_slice(self, w_in_XD: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
        """Shard `shard` of `shards` of the first layer's rows (--etp-size): its hidden units' rows, and for a
        gated kind the matching rows of the gate and of the up projection, stacked as the kind stacks them."""
        if not self.gated:
            return hidden_rows(w_in_XD, shard, shards)
        gate_FD, up_FD = w_in_XD.chunk(2, dim=0)
        return torch.cat([hidden_rows(gate_FD, shard, shards), hidden_rows(up_FD, shard, shards)])

    def join_hidden(self, w_in_shards_LXD: list[torch.Tensor]) -> torch.Tensor:
        """The whole experts' first layers [L, X, D] from their shards' (hidden_slice's inverse, stacked experts)."""
        if not self.gated:
            return torch.cat(w_in_shards_LXD, dim=1)
        halves = [w.chunk(2, dim=1) for w in w_in_shards_LXD]
        return torch.cat([torch.cat([gate for gate, _ in halves], dim=1), torch.cat([up for _, up in halves], dim=1)],
                         dim=1)

    # ---- the autograd Function's middle (moe/experts/ffn.py): grouped products in, grouped products out

    def first_layer(self, rows_RD, w_in_LXD, layout: GroupLayout, row_of_pair_M) -> torch.Tensor:
        """What the backward needs of the first layer, per pair [M, X] (kept, or recomputed)."""
        raise NotImplementedError

    def hidden(self, first_MX: torch.Tensor) -> torch.Tensor:
        """The hidden layer [M, F] from `first_layer`'s output."""
        raise NotImplementedError

    def hidden_backward(self, grad_out, row_of_pair_M, w_out_LFD, first_MX, coef_M, layout: GroupLayout, scale: float,
                        gate_dtype, need_gate: bool, need_w_out: bool, w_out_buffer):
        """(gradient of the first layer's output [M, X], of the gates or None, of w_out or None) from the output
        gradient `grad_out` ([R, D] read through `row_of_pair_M`, or per pair [M, D])."""
        raise NotImplementedError

    def dense(self, x_ND: torch.Tensor, w_in_XD: torch.Tensor, w_out_FD: torch.Tensor) -> torch.Tensor:
        """One expert (or experts side by side) as a plain FFN, before the output scale: the reference."""
        raise NotImplementedError


class ReLUExperts(ExpertKind):
    """Shazeer et al. 2017's experts: Glorot-uniform weights (drawn [D, F] and transposed into w_in), output scaled
    by sqrt(D/F) (t2t's autoscale) so an expert's output keeps unit scale whatever F is. On CPU the native kernels
    apply the ReLU as they store the first product and its backward as they read the output gradient."""

    name = "relu"

    def output_scale(self, d_model: int, hidden: int) -> float:
        return math.sqrt(d_model / hidden)

    def init_expert(self, w_in_XD, w_out_FD, generator):
        hidden, d_model = w_in_XD.shape
        bound = math.sqrt(6.0 / (d_model + hidden))
        w_in_DF = torch.empty(d_model, hidden, device=w_in_XD.device).uniform_(-bound, bound, generator=generator)
        w_in_XD.copy_(w_in_DF.t())
        w_out_FD.uniform_(-bound, bound, generator=generator)

    def first_layer(self, rows_RD, w_in_LXD, layout, row_of_pair_M):
        return rows_times_expert(rows_RD, w_in_LXD.transpose(1, 2), layout, row_of_pair_M, relu=True)

    def hidden(self, first_MX):
        return first_MX

    def hidden_backward(self, grad_out, row_of_pair_M, w_out_LFD, first_MX, coef_M, layout, scale, gate_dtype,
                        need_gate, need_w_out, w_out_buffer):
        hidden_MF, grad_gate, grad_w_out = first_MX, None, None
        grad_hidden_MF, dot_M, grad_y_MD = _relu_hidden_gradient(grad_out, row_of_pair_M, w_out_LFD, hidden_MF,
                                                                 coef_M, layout, need_gate, keep_grad_y=need_w_out)
        if need_gate:   # dL/dg_m = scale * <G_m @ w_out[e].T, hidden_m> (ffn.py's _ExpertFFN)
            grad_gate = gate_gradient(dot_M, scale, gate_dtype)
        del dot_M
        if need_w_out:   # a gathered copy is ours to scale in place; the incoming gradient is not
            grad_y_MD = per_pair(grad_out, row_of_pair_M) if grad_y_MD is None else grad_y_MD
            grad_y_MD = grad_y_MD.mul_(coef_M[:, None]) if row_of_pair_M is not None else grad_y_MD * coef_M[:, None]
            grad_w_out = per_expert_outer(hidden_MF, grad_y_MD, layout, w_out_buffer)
        return grad_hidden_MF, grad_gate, grad_w_out

    def dense(self, x_ND, w_in_XD, w_out_FD):
        return torch.relu(F.linear(x_ND, w_in_XD)) @ w_out_FD.to(x_ND.dtype)


class GatedExperts(ExpertKind):
    """A GLU expert: [a, b] = x W_inᵀ, hidden = act(a) · b, y = hidden W_out; every matrix N(0, 0.02²) (as
    transformers initialises Mixtral's), w_in before w_out from the expert's generator; no output scale. The first
    layer is one grouped product of width 2F (transformers 5 stores Mixtral's experts the same way: `gate_up_proj`);
    the output gradient is read through `row_of_pair` (never gathered into an [M, D] copy)."""

    gated = True

    def act(self, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def act_grad_times(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x · act'(a)."""
        raise NotImplementedError

    def forward_macs(self, d_model: int, hidden: int) -> int:
        return 3 * d_model * hidden

    def stored_per_hidden(self) -> int:
        return 3   # gate, up and their product

    def init_expert(self, w_in_XD, w_out_FD, generator):
        w_in_XD.normal_(0.0, GATED_INIT_STD, generator=generator)
        w_out_FD.normal_(0.0, GATED_INIT_STD, generator=generator)

    def first_layer(self, rows_RD, w_in_LXD, layout, row_of_pair_M):
        return rows_times_expert(rows_RD, w_in_LXD.transpose(1, 2), layout, row_of_pair_M)

    def hidden(self, first_MX):
        a_MF, b_MF = first_MX.chunk(2, dim=1)
        return self.act(a_MF) * b_MF

    def hidden_backward(self, grad_out, row_of_pair_M, w_out_LFD, first_MX, coef_M, layout, scale, gate_dtype,
                        need_gate, need_w_out, w_out_buffer):
        grad_out = grad_out.contiguous()
        a_MF, b_MF = first_MX.chunk(2, dim=1)
        act_a_MF = self.act(a_MF)
        hidden_MF = act_a_MF * b_MF
        grad_gate = grad_w_out = None
        # G_m @ w_out[e].T per pair, G_m read through row_of_pair (per unit of coef)
        grad_hidden_MF = rows_times_expert(grad_out, w_out_LFD.transpose(1, 2), layout, row_of_pair_M)
        if need_gate:
            grad_gate = gate_gradient(row_dot(grad_hidden_MF, hidden_MF), scale, gate_dtype)
        grad_hidden_MF.mul_(coef_M[:, None])
        if need_w_out:   # sum over pairs of (coef_m hidden_m)ᵀ G_m: the hidden side is scaled, G is read in place
            grad_w_out = per_expert_outer(hidden_MF.mul_(coef_M[:, None]), grad_out, layout, w_out_buffer,
                                          row_of_pair_M)
        del hidden_MF
        return torch.cat([self.act_grad_times(grad_hidden_MF * b_MF, a_MF), grad_hidden_MF * act_a_MF], dim=1), \
            grad_gate, grad_w_out

    def dense(self, x_ND, w_in_XD, w_out_FD):
        gate_FD, up_FD = w_in_XD.chunk(2, dim=0)
        return (self.act(F.linear(x_ND, gate_FD)) * F.linear(x_ND, up_FD)) @ w_out_FD.to(x_ND.dtype)


class SwiGLUExperts(GatedExperts):
    name, hf_act = "swiglu", "silu"

    def act(self, a):
        return F.silu(a)

    def act_grad_times(self, x, a):
        sigmoid_a = torch.sigmoid(a)
        return x * sigmoid_a * (1 + a * (1 - sigmoid_a))


class GeGLUExperts(GatedExperts):
    name, hf_act = "geglu", "gelu"

    def act(self, a):
        return F.gelu(a)

    def act_grad_times(self, x, a):   # Φ(a) + a φ(a)
        return x * (0.5 * (1 + torch.erf(a * 0.5 ** 0.5)) + a * torch.exp(-0.5 * a * a) * (2 * math.pi) ** -0.5)


EXPERT_KINDS: dict[str, ExpertKind] = {kind.name: kind for kind in (ReLUExperts(), SwiGLUExperts(), GeGLUExperts())}


def expert_kind(kind: str | ExpertKind) -> ExpertKind:
    if isinstance(kind, ExpertKind):
        return kind
    if kind not in EXPERT_KINDS:
        raise ValueError(f"expert kind must be one of {tuple(EXPERT_KINDS)}, got {kind!r}")
    return EXPERT_KINDS[kind]


def _relu_hidden_gradient(grad_out, row_of_pair_M, w_out_LFD, hidden_MF, coef_M, layout: GroupLayout, need_dot: bool,
                          keep_grad_y: bool):
    """(gradient of the hidden layer's input: (G_m @ w_out[e].T) * coef_m where hidden > 0, else 0; the dot
    products <G_m @ w_out[e].T, hidden_m> if `need_dot`; the gathered G if `keep_grad_y` and one was gathered),
    with G_m the output gradient of pair m. The native kernel gathers G, multiplies and applies the ReLU's backward
    in one pass; otherwise torch's ops."""
    if layout.kernel == "native":
        return *cpu_kernels.rows_times_wt(grad_out, w_out_LFD, layout.offsets_L1, row_of_pair_M,
                                          relu_grad=(hidden_MF, coef_M)), None
    grad_y_MD = per_pair(grad_out, row_of_pair_M)
    grad_hidden_MF = rows_times_expert(grad_y_MD, w_out_LFD.transpose(1, 2), layout)   # per unit of coef
    dot_M = row_dot(grad_hidden_MF, hidden_MF) if need_dot else None
    # ReLU: hidden > 0 exactly where its input was. threshold_backward in place: no [M, F] mask temporary.
    torch.ops.aten.threshold_backward.grad_input(grad_hidden_MF.mul_(coef_M[:, None]), hidden_MF, 0,
                                                 grad_input=grad_hidden_MF)
    return grad_hidden_MF, dot_M, grad_y_MD if keep_grad_y and row_of_pair_M is not None else None


def per_pair(t_RD: torch.Tensor, row_of_pair_M: torch.Tensor | None) -> torch.Tensor:
    """t[row_of_pair[m]] for each pair m ([M, D], a copy), or t itself when its rows are the pairs."""
    return t_RD.contiguous() if row_of_pair_M is None else t_RD.index_select(0, row_of_pair_M)


def hidden_rows(w: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
    """Rows [shard F / shards, (shard + 1) F / shards) of a matrix whose F rows are hidden units (--etp-size)."""
    per = w.shape[0] // shards
    return w[shard * per:(shard + 1) * per]
