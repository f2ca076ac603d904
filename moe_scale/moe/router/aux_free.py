"""Auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3, Liu et al. 2024, §2.1.2, eq. 12-20).

Legend (docs/shapes.md): N tokens, D model width, E experts, K experts per token, C (token, expert) pairs,
B sequences, T positions.

The gate scores every expert, s = sigmoid(x W_g) (or a softmax over the experts), and picks each token's top K
of s + b, where b [E] is a per-expert bias that no gradient touches: after every optimizer step it moves by
b_i += u · sign(mean load - load_i), the load being the tokens each expert took over the step's whole
data-parallel batch (every micro-batch). The gate values come from the unbiased scores of the chosen experts
(sigmoid: divided by their sum; softmax: as they are), so the bias decides where a token goes and never how much
of the expert's output it takes, nor the gradient of that. No CV² loss: the only (optional) loss is
DeepSeek-V3's sequence-wise balance loss, α Σ_i f_i P_i per sequence (eq. 17-20), averaged over sequences.
"""

from __future__ import annotations


import torch
from torch import Tensor, nn

from moe_scale.config import AuxFreeConfig, RouterConfig, choices
from moe_scale.moe.kernel_policy import count_per_bin
from moe_scale.moe.router.base import Router, RouterOutput

SCORES = choices(AuxFreeConfig, "score")


def sequence_balance_sums(scores_NE: Tensor, experts_NK: Tensor, seq_len: int,
                          weight_N: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(Σ over sequences of Σ_i f_i P_i, the number of sequences) for DeepSeek-V3's sequence-wise balance loss.

    Per sequence of T tokens (eq. 18-20): f_i = E / (K T) · #{t: i among t's chosen experts} (no gradient),
    P_i = (1/T) Σ_t s_{i,t} / Σ_j s_{j,t}. Rows are sequences of `seq_len` consecutive tokens; `weight_N` (1 for
    a real token, 0 for padding) leaves padding out of T and of both sums, and a sequence of padding only out of
    the count. Returned as sums, so a data-parallel sum of both gives the mean over the whole batch."""
    n, e = scores_NE.shape
    k = experts_NK.shape[1]
    if n % seq_len:
        raise ValueError(f"{n} rows are not whole sequences of {seq_len} tokens")
    chosen_NE = torch.zeros_like(scores_NE).scatter_(1, experts_NK, 1.0)
    share_NE = scores_NE / scores_NE.sum(1, keepdim=True).clamp_min(torch.finfo(scores_NE.dtype).tiny)
    w_N = scores_NE.new_ones(n) if weight_N is None else weight_N.to(scores_NE.dtype)
    w_BT1 = w_N.view(-1, seq_len, 1)
    tokens_B = w_BT1.sum((1, 2))
    per_token_B = 1.0 / tokens_B.clamp_min(1.0)
    f_BE = (chosen_NE.view(-1, seq_len, e) * w_BT1).sum(1) * (e / k * per_token_B)[:, None]
    p_BE = (share_NE.view(-1, seq_len, e) * w_BT1).sum(1) * per_token_B[:, None]
    return (f_BE.detach() * p_BE).sum(), (tokens_B > 0).to(scores_NE.dtype).sum()


class AuxFreeRouter(Router):
    """Top-k of (score + bias) with gates from the scores alone; the bias follows the load (module docstring).

    `score_bias` is a persistent buffer (checkpointed with the model, the same on every rank: each applies the
    same update from the same all-reduced load) and stays float32 when the model is cast to bf16 or fp16, where
    an update of 0.001 would round away once |b| passes 0.25. The loads of the training forwards since the last
    `begin_step` are summed on the device; `after_step` (the training loop's, once per optimizer step) applies
    them, with no host read. A forward's statistics travel in one collective ([2E], or [2E + 2] with the
    sequence-wise loss): importance (summed gates), the load (pairs per expert) and the loss's sums.

    `w_gate [D, E]` has no bias and starts from N(0, (1e-2/√D)²), as the softmax top-k gate: zero logits would
    tie everywhere. The name avoids the substring "expert" (DeepSpeed treats such names as expert weights).
    """

    takes_valid_rows = True
    takes_seq_len = True
    balances_after_step = True
    replays = True

    name, section = "aux_free", "aux_free"

    @classmethod
    def gating_counts(cls, config, d_model, num_experts):
        return d_model * num_experts, d_model * num_experts   # W_g [D, E]; the routing biases are a buffer

    def __init__(self, d_model: int, num_experts: int, k: int, score: str = "sigmoid",
                 bias_update_rate: float = 0.001, seq_balance_weight: float = 0.0):
        super().__init__(d_model, num_experts, k)
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if bias_update_rate < 0 or seq_balance_weight < 0:
            raise ValueError("bias_update_rate and seq_balance_weight must not be negative")
        self.score, self.bias_update_rate, self.seq_balance_weight = score, bias_update_rate, seq_balance_weight
        self.w_gate = nn.Parameter(torch.empty(d_model, num_experts))
        self.small_init_(self.w_gate, d_model)
        self.register_buffer("score_bias", torch.zeros(num_experts))
        self._pending_load_E: Tensor | None = None   # the step's load so far (training forwards), on the device

    @classmethod
    def from_config(cls, config: RouterConfig, d_model: int, num_experts: int, ep_size: int = 1,
                    ep_rank: int = 0) -> "AuxFreeRouter":
        a = config.aux_free
        return cls(d_model, num_experts, config.top_k, score=a.score, bias_update_rate=a.bias_update_rate,
                   seq_balance_weight=a.seq_balance_weight)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_experts={self.num_experts}, k={self.k}, score={self.score!r}, "
                f"bias_update_rate={self.bias_update_rate}, seq_balance_weight={self.seq_balance_weight}")

    def _apply(self, fn, recurse=True):
        """As nn.Module's (device moves, casts), but a cast below float32 leaves the bias as it was (moved)."""
        bias = self.score_bias
        super()._apply(fn, recurse)
        cast = self.score_bias
        if cast.is_floating_point() and torch.finfo(cast.dtype).bits < 32:
            self.score_bias = bias.to(device=cast.device)
        return self

    def scores(self, logits_NE: Tensor) -> Tensor:
        return torch.sigmoid(logits_NE) if self.score == "sigmoid" else torch.softmax(logits_NE, dim=1)

    def choose(self, biased_NE: Tensor) -> Tensor:
        """Each token's K experts from its biased scores, descending."""
        return biased_NE.topk(self.k, dim=1).indices

    def gates(self, chosen_NK: Tensor) -> Tensor:
        """The gates of the chosen experts' unbiased scores: sigmoid's normalised over them (eq. 13)."""
        if self.score == "sigmoid":
            return chosen_NK / chosen_NK.sum(1, keepdim=True).clamp_min(torch.finfo(chosen_NK.dtype).tiny)
        return chosen_NK

    def gates_for(self, experts_NK: Tensor) -> Tensor:
        """The gates of `experts_NK` from the last route()'s scores (their gradient flows to them)."""
        return self.gates(self._scores_NE.gather(1, experts_NK))

    def balance_loss(self, importance_E: Tensor) -> Tensor | None:
        """A loss on the batch's importance besides the sequence-wise one (None: none)."""
        return None

    def route(self, x_ND: Tensor, valid_N: Tensor | None = None, seq_len: int | None = None) -> RouterOutput:
        k, e = self.k, self.num_experts
        scores_NE = self.scores(self.logits(x_ND, self.w_gate))
        biased_NE = scores_NE.detach() + self.score_bias.to(scores_NE.dtype)
        experts_NK = self.choose(biased_NE)
        gates_NK = self.gates(scores_NE.gather(1, experts_NK))
        if self.keep_scores:
            self._scores_NE = scores_NE

        flat_experts = experts_NK.reshape(-1)
        if valid_N is None:
            importance_E = gates_NK.new_zeros(e).index_add(0, flat_experts, gates_NK.reshape(-1))
            count_E = count_per_bin(flat_experts, e, x_ND.dtype)
        else:   # padding rows weigh 0
            if valid_N.shape != (x_ND.shape[0],):
                raise ValueError(f"valid_N must have shape ({x_ND.shape[0]},), got {tuple(valid_N.shape)}")
            w_C = valid_N.to(x_ND.dtype).repeat_interleave(k, output_size=x_ND.shape[0] * k)
            importance_E = gates_NK.new_zeros(e).index_add(0, flat_experts, gates_NK.reshape(-1) * w_C)
            count_E = w_C.new_zeros(e).index_add_(0, flat_experts, w_C)
        parts = [importance_E, count_E]
        if self.seq_balance_weight:
            parts += [t[None] for t in sequence_balance_sums(scores_NE, experts_NK, seq_len or x_ND.shape[0],
                                                             valid_N)]
        stats = self.batch.sum(torch.cat(parts))   # one collective: the whole data-parallel batch's
        importance_E, count_E = stats[:e], stats[e:2 * e].detach()

        metrics: dict = {"bias_spread": (self.score_bias.max() - self.score_bias.min()).detach()}
        if self.seq_balance_weight:
            seq_loss = stats[2 * e] / stats[2 * e + 1].detach().clamp_min(1.0)
            aux_loss = self.seq_balance_weight * seq_loss
            metrics["seq_balance_loss"] = seq_loss.detach()
        else:
            aux_loss = stats.new_zeros(())
        if (extra := self.balance_loss(importance_E)) is not None:
            aux_loss = aux_loss + extra
        if self.training:
            self._pending_load_E = count_E if self._pending_load_E is None else self._pending_load_E + count_E
        return RouterOutput.from_top_k(gates_NK, experts_NK, aux_loss, importance_E, count_E, metrics)

    def begin_step(self) -> None:
        """Forget the loads seen so far: the step's own forwards follow (not, e.g., MAE's G step before them)."""
        self._pending_load_E = None

    @torch.no_grad()
    def after_step(self) -> None:
        """b_i += u · sign(mean load - load_i) from the loads of the step's training forwards, then forget them."""
        load_E, self._pending_load_E = self._pending_load_E, None
        if load_E is None or not self.bias_update_rate:
            return
        step_E = torch.sign(load_E.mean() - load_E).to(self.score_bias.dtype)
        self.score_bias.add_(step_E, alpha=self.bias_update_rate)
