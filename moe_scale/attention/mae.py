"""MAE: a mixture of the h experts "all heads but one" (Peng et al. 2020; spec §4).

Legend (docs/shapes.md): B sequences, T positions, Tc positions cached for generation, N tokens (B·T),
D model width, H attention heads (h, the original count; H' of them still present).

Expert i is f_i = h/(h−1)·(Σ_j H_j − H_i), H_j head j's output through its block of W_o. The mixture
Z = Σ_i g_i f_i equals Σ_j c_j H_j with c_j = h/(h−1)·(1 − g_j), so it runs as one multi-head attention
with per-token head weights c (spec §4.1); W_o's bias is added once. Uniform g gives c ≡ 1: plain MHA.

Gate g(·; φ) (§4.2): the mean of the most recent `window` input vectors (a causal prefix mean, so position t
never sees t+1 and every position has its own gate), BatchNorm (normalising with running statistics, see
CausalBatchNorm), Linear(D, 256) → tanh → dropout(0.1) →
Linear(256, h) → softmax.

Modes: "mixture" (the G step, joint training and evaluation: c from g) and "sample" (the F step: g without
gradient, one expert i ~ Cat(g) drawn per token — each token is one prediction instance of the LM — so
c = h/(h−1)·(1 − onehot(i)): head i dropped, the others scaled).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_scale.attention.mha import MultiHeadAttention

GATE_HIDDEN = 256
GATE_WINDOW = 100


def causal_window_mean(x_BTD: torch.Tensor, window: int) -> torch.Tensor:
    """out[:, t] = mean of x[:, max(0, t−window+1) .. t]."""
    prefix_BTD = x_BTD.cumsum(dim=1)
    shifted_BTD = torch.zeros_like(prefix_BTD)
    if x_BTD.shape[1] > window:
        shifted_BTD[:, window:] = prefix_BTD[:, :-window]
    count_T = torch.arange(1, x_BTD.shape[1] + 1, device=x_BTD.device).clamp(max=window).to(x_BTD.dtype)
    return (prefix_BTD - shifted_BTD) / count_T[None, :, None]


class CausalBatchNorm(nn.BatchNorm1d):
    """BatchNorm that normalises with its running statistics also in training (the batch updates them after).

    A plain BatchNorm normalises each position with the mean and variance of the whole batch, future positions
    included — a (small) leak of future tokens into the gate during training. The paper does not say; we keep
    the decoder strictly causal."""

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        # Statistics from before this batch (clones: the update below is in place and autograd keeps them).
        out = nn.functional.batch_norm(x_ND, self.running_mean.clone(), self.running_var.clone(), self.weight,
                                       self.bias, training=False, eps=self.eps)
        if self.training:
            with torch.no_grad():
                nn.functional.batch_norm(x_ND.detach(), self.running_mean, self.running_var, training=True,
                                         momentum=self.momentum, eps=self.eps)
        return out


class MAEGate(nn.Module):
    def __init__(self, d_model: int, num_heads: int, window: int = GATE_WINDOW, hidden: int = GATE_HIDDEN,
                 dropout: float = 0.1):
        super().__init__()
        self.window = window
        self.norm = CausalBatchNorm(d_model)
        self.hidden = nn.Linear(d_model, hidden)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, num_heads)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """g [B, T, h]: a distribution over the h experts at every position."""
        B, T, D = x_BTD.shape
        mean_ND = self.norm(causal_window_mean(x_BTD, self.window).reshape(B * T, D))
        logits = self.out(self.dropout(torch.tanh(self.hidden(mean_ND))))
        return torch.softmax(logits.float(), dim=-1).view(B, T, -1)


class MAEAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, head_dim: int, dropout: float = 0.0):
        super().__init__()
        self.num_experts = num_heads
        self.mha = MultiHeadAttention(d_model, num_heads, head_dim, dropout)
        self.gate = MAEGate(d_model, num_heads)
        self.mode = "mixture"
        self.last_gates_BTH: torch.Tensor | None = None   # detached, for gate statistics (entropy, shares)

    def sampling(self) -> bool:
        """F-step sampling happens in training only; evaluation always uses the mixture."""
        return self.mode == "sample" and self.training

    def head_weights(self, gates_BTH: torch.Tensor) -> torch.Tensor:
        """c [B, T, h] of the current mode from the gate's distribution."""
        h = self.num_experts
        if self.sampling():
            draw_N = torch.multinomial(gates_BTH.reshape(-1, h).detach(), 1)[:, 0]
            dropped_BTH = nn.functional.one_hot(draw_N, h).view(gates_BTH.shape).to(gates_BTH.dtype)
            return h / (h - 1) * (1 - dropped_BTH)
        return h / (h - 1) * (1 - gates_BTH)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, None]:
        """(output [B, T, D], None: the gate is trained by block coordinate descent, not by a loss term)."""
        if self.sampling():
            with torch.no_grad():
                gates_BTH = self.gate(x_BTD)
        else:
            gates_BTH = self.gate(x_BTD)
        self.last_gates_BTH = gates_BTH.detach()
        weights_BTH = self.head_weights(gates_BTH)[..., self.mha.head_ids]   # pruned heads keep their own c_j
        return self.mha.attend(x_BTD, head_weights_BTH=weights_BTH), None

    def decode(self, x_BTD: torch.Tensor, cache: dict) -> torch.Tensor:
        """Generation: the mixture for the new positions; the gate's window reads the last `window` - 1 inputs
        kept in cache["x"], the heads the keys and values in the same cache (MultiHeadAttention.decode)."""
        T, window = x_BTD.shape[1], self.gate.window
        seen_BTcD = torch.cat([cache["x"], x_BTD], dim=1) if "x" in cache else x_BTD
        cache["x"] = seen_BTcD[:, -(window - 1):] if window > 1 else seen_BTcD[:, :0]
        gates_BTH = self.gate(seen_BTcD)[:, -T:]
        weights_BTH = self.head_weights(gates_BTH)[..., self.mha.head_ids]
        return self.mha.decode(x_BTD, cache, head_weights_BTH=weights_BTH)

    def gate_parameters(self) -> list[nn.Parameter]:
        return list(self.gate.parameters())
