"""Shared experts (DeepSeekMoE, Dai et al. 2024; Qwen2-MoE): FFN experts every token goes through, their output
added to the routed experts'.

Legend (docs/shapes.md): N tokens, D model width, F an expert's hidden width.

S shared experts of hidden width F are one dense FFN of width S·F: the sum of S FFNs D -> F -> D equals one
D -> S·F -> D whose hidden units are theirs side by side, so they cost one product per matrix, not S. They are of
the routed experts' kind (moe/experts/kinds.py: its activation and output scale; a ReLU expert drawn as a routed
one is, a gated kind's gate, up and down matrices as three nn.Linear, transformers' layout), each drawn from a
generator of its own, so it starts the same on every rank and whatever --ep-size; shared
expert s of a layer of E routed experts is drawn as routed expert E + s would be. With `gate` (Qwen2-MoE) the
output is scaled per token by sigmoid(x · w_gate), w_gate [D] starting at zero (a scale of 1/2).

They are dense parameters: replicated on every rank, their gradients averaged over the data-parallel group like
every non-expert weight. Their names avoid the substring "expert", which DeepSpeed reads as an expert weight.
"""

from __future__ import annotations


import torch
from torch import nn

from moe_scale.moe.experts.kinds import GATED_INIT_STD, ExpertKind, expert_kind


class SharedExperts(nn.Module):
    def __init__(self, d_model: int, d_hidden: int, num_shared: int, gate: bool = False, seed: int = 0,
                 first_id: int = 0, activation: str | ExpertKind = "relu"):
        """`num_shared` experts of width `d_hidden`; the generator of expert s is seeded as routed expert
        `first_id + s`'s (moe/experts/ffn.py)."""
        super().__init__()
        if num_shared < 1 or d_hidden < 1:
            raise ValueError(f"shared experts need num_shared >= 1 and d_hidden >= 1, got {num_shared}, {d_hidden}")
        self.kind = expert_kind(activation)
        self.d_model, self.d_hidden, self.num_shared = d_model, d_hidden, num_shared
        self.seed, self.first_id = seed, first_id
        width = num_shared * d_hidden
        if self.kind.gated:
            with torch.random.fork_rng(devices=[]):   # nn.Linear's own draws, overwritten below: the RNG untouched
                self.gate_proj = nn.Linear(d_model, width, bias=False)
                self.up_proj = nn.Linear(d_model, width, bias=False)
                self.down_proj = nn.Linear(width, d_model, bias=False)
        else:
            self.w_in = nn.Parameter(torch.empty(width, d_model))    # nn.Linear's (out, in)
            self.w_out = nn.Parameter(torch.empty(width, d_model))
        self.w_gate = nn.Parameter(torch.zeros(d_model)) if gate else None
        self.output_scale = self.kind.output_scale(d_model, d_hidden)   # a routed expert's of width F
        self.reset_parameters()

    @property
    def activation(self) -> str:
        return self.kind.name

    def reset_parameters(self) -> None:
        if next(self.parameters()).is_meta:   # shapes only (moe-scale flops / plan)
            return
        if self.kind.gated:
            self._reset_gated()
            return
        f = self.d_hidden
        with torch.no_grad():
            for s in range(self.num_shared):
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first_id + s)
                self.kind.init_expert(self.w_in[s * f:(s + 1) * f], self.w_out[s * f:(s + 1) * f], generator)
            if self.w_gate is not None:
                self.w_gate.zero_()

    @torch.no_grad()
    def _reset_gated(self) -> None:
        f = self.d_hidden
        for s in range(self.num_shared):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first_id + s)
            for weight in (self.gate_proj.weight[s * f:(s + 1) * f], self.up_proj.weight[s * f:(s + 1) * f],
                           self.down_proj.weight[:, s * f:(s + 1) * f]):
                weight.copy_(torch.empty(weight.shape).normal_(0.0, GATED_INIT_STD, generator=generator))
        if self.w_gate is not None:
            self.w_gate.zero_()

    def extra_repr(self) -> str:
        return (f"num_shared={self.num_shared}, d_model={self.d_model}, d_hidden={self.d_hidden}, "
                f"gate={self.w_gate is not None}, activation={self.activation}")

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        if self.kind.gated:
            y_ND = self.down_proj(self.kind.act(self.gate_proj(x_ND)) * self.up_proj(x_ND))
        else:
            y_ND = self.kind.dense(x_ND, self.w_in, self.w_out) * self.output_scale   # [N, S·F] hidden inside
        if self.w_gate is not None:
            y_ND = y_ND * torch.sigmoid(x_ND @ self.w_gate.to(x_ND.dtype))[:, None].to(y_ND.dtype)
        return y_ND
