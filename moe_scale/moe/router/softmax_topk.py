"""MoA-style softmax top-k router (Zhang et al. 2022, Mixture of Attention Heads, eq. 7-9 and 13-16; spec §3.1-3.3).

Legend (docs/shapes.md): N tokens, D model dim, E experts, K top-k, C (token, expert) pairs.

The data-parallel sum of its statistics (``batch.sum``) is injected by the layer (moe/router/base.py).
"""


import torch
from torch import Tensor, nn

from moe_scale.moe.kernel_policy import count_per_bin
from moe_scale.config import RouterConfig, SoftmaxTopKConfig, choices
from moe_scale.moe.router.base import Router, RouterOutput

RENORMALIZE_MODES = choices(SoftmaxTopKConfig, "renormalize")


def switch_loss(prob_sum_E: Tensor, count_E: Tensor) -> Tensor:
    """``L_a = E · Σ_i (P_i/‖P‖₁) · (f_i/‖f‖₁)`` (MoA eq. 13-15, ``compute_switchloss``), from batch sums.

    ``prob_sum_E[i]`` = Σ_tokens p_{t,i} (router probabilities, carries the gradient), ``count_E[i]`` = number of
    token selections of expert i (no gradient). Both are L1-normalised, so the result is 1 when either is uniform
    (in particular at perfect balance and whenever k == E) and E when every token puts probability ≈ 1 on one expert
    and (k == 1) selects it. Empty batches give 0 (the norms are clamped), never NaN.
    """
    e = prob_sum_E.shape[-1]
    p_E = prob_sum_E / prob_sum_E.sum().clamp_min(1e-12)
    f_E = count_E / count_E.sum().clamp_min(1.0)
    return e * (p_E * f_E).sum()


class SoftmaxTopKRouter(Router):
    """Softmax top-k gate of MoA with the switch (load-balancing) loss and the z-loss.

    Routing (eq. 7-9): ``probs_NE = softmax(x W_g)`` over all E experts, in float32 (at least) with autocast off;
    the K largest probabilities are kept. ``renormalize`` picks the gate weights (spec §3.3, §7 item 10):

    - ``"none"`` (default, the released MoA code, which produced the paper's BLEU numbers): ``gates = top-k probs``,
      which sum to < 1 when K < E; the router gets task-loss gradient through every kept probability, also at K == 1.
    - ``"detached"`` (paper eq. 9): ``gates = p_i / Detach(Σ_{j∈topk} p_j)``; rows sum to 1 in the forward pass, but
      the denominator carries no gradient. Identical forward values to ``"none"`` when K == E.
    - ``"full"`` (Mixtral, transformers' ``MixtralTopKRouter``): ``gates = p_i / Σ_{j∈topk} p_j`` with the
      denominator's gradient, i.e. a softmax over the K kept logits: forward values as ``"detached"``, but the
      gradient of the gates along their sum vanishes (they always sum to 1). At K == 1 the gate is a constant 1
      and the router learns only from its losses.

    Losses (eq. 13-16), added to the model loss as ``aux_loss = aux_weight · L_a + z_weight · L_z``:

    - ``L_a = E · Σ_i P̂_i f̂_i`` (see :func:`switch_loss`): ``P̂`` the mean router probability per expert, ``f̂`` the
      fraction of the N·K token selections that went to each expert. 1 at uniform routing, E when collapsed; when
      K == E every token selects every expert, so ``L_a ≡ 1`` with zero gradient and only the z-loss acts.
    - ``L_z = mean_t logsumexp(logits_t)²`` (computed with ``torch.logsumexp``; the MoA code's naive
      ``log(exp(.).sum())`` overflows for large logits, same value otherwise).

    Every mean is over the whole data-parallel batch: the per-rank sums (prob sums per expert, importance per expert,
    selection counts per expert, Σ lse², token count) travel as one stacked ``[3E + 2]`` tensor through
    ``batch.sum`` -- one collective per forward, called on every rank even when it has no tokens. It must be an
    autograd-aware all-reduce(SUM) (``BatchCollectives.sum``: its backward sums the gradients too); a detached one
    shrinks the router gradient by world_size. ``importance_E`` (Σ_tokens of the dense gates) and ``load_E`` (hard
    selection counts) are global too. Counts are summed in the statistics' float dtype (exact up to 2^24 per
    expert in float32).

    Loss reduction (spec §3.2, §7 item 11): these terms are meant to be added to a per-token **mean** cross-entropy,
    so ``aux_weight`` (α) and ``z_weight`` (β) are relative to the mean loss (the Switch Transformer convention).
    The MoA reference code adds ``0.01·L_a + 0.001·L_z`` to a token-**summed** CE that fairseq then divides by the
    token count, so its effective weights are ≈ α / (tokens per micro-batch) -- with ``--max-tokens 8192``,
    0.01 / 8192 ≈ 1.2e-6: our default balancing is about 10⁴ times stronger than the released code. To reproduce
    the code's strength, pass ``aux_weight = α / tokens_per_batch`` (likewise for ``z_weight``). We chose the mean
    because it puts α, β on the same scale as the Shazeer importance/load losses of the other routers, and the
    balancing strength does not change with the batch size or the number of gradient-accumulation steps.

    Initialisation (deviation from the MoA code, spec §3.1 "zero-init tie", §7 item 3): ``w_gate [D, E]`` has no
    bias and starts from ``N(0, (1e-2/√D)²)`` instead of zeros. Zero init makes every probability tie, so top-k
    would send every token to the same K experts at step 0; the small random init breaks the tie while keeping the
    initial router close to uniform (logits ~ 1e-2 for unit-scale inputs). The parameter name avoids the substring
    "expert" (DeepSpeed treats such names as expert weights). Padding rows (``valid_N`` False, evaluation's last
    windows) are routed like any row but left out of every sum above, so its losses and metrics are the real tokens'.
    """

    takes_valid_rows = True
    replays = True

    name, section = "softmax_topk", "softmax_topk"

    @classmethod
    def gating_counts(cls, config, d_model, num_experts):
        return d_model * num_experts, d_model * num_experts   # W_g [D, E], no noise

    @classmethod
    def exports_as_mixtral(cls, config):
        return config.softmax_topk.renormalize == "full"   # softmax, top-k, renormalised with their gradient

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        k: int,
        aux_weight: float = 0.01,
        z_weight: float = 0.001,
        renormalize: str = "none",
    ):
        super().__init__(d_model, num_experts, k)
        if renormalize not in RENORMALIZE_MODES:
            raise ValueError(f"renormalize must be one of {RENORMALIZE_MODES}, got {renormalize!r}")
        self.aux_weight, self.z_weight, self.renormalize = aux_weight, z_weight, renormalize
        self.w_gate = nn.Parameter(torch.empty(d_model, num_experts))
        self.small_init_(self.w_gate, d_model)

    @classmethod
    def from_config(cls, config: RouterConfig, d_model: int, num_experts: int, ep_size: int = 1,
                    ep_rank: int = 0) -> "SoftmaxTopKRouter":
        s = config.softmax_topk
        return cls(d_model, num_experts, config.top_k, aux_weight=s.aux_weight, z_weight=s.z_weight,
                   renormalize=s.renormalize)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_experts={self.num_experts}, k={self.k}, renormalize={self.renormalize!r}, "
            f"aux_weight={self.aux_weight}, z_weight={self.z_weight}"
        )

    def _renormalized(self, top_p_NK: Tensor) -> Tensor:
        if self.renormalize == "detached":  # eq. 9: the denominator carries no gradient
            return top_p_NK / top_p_NK.sum(dim=1, keepdim=True).detach()
        if self.renormalize == "full":   # Mixtral: the sum keeps its gradient
            return top_p_NK / top_p_NK.sum(dim=1, keepdim=True)
        return top_p_NK

    def gates_for(self, experts_NK: Tensor) -> Tensor:
        """The gates of `experts_NK` from the last route()'s probabilities (their gradient flows to them)."""
        return self._renormalized(self._probs_NE.gather(1, experts_NK))

    def route(self, x_ND: Tensor, valid_N: Tensor | None = None) -> RouterOutput:
        k, e = self.k, self.num_experts
        logits_NE = self.logits(x_ND, self.w_gate)
        probs_NE = torch.softmax(logits_NE, dim=1)
        top_p_NK, experts_NK = probs_NE.topk(k, dim=1)  # sorted descending
        gates_NK = self._renormalized(top_p_NK)
        if self.keep_scores:
            self._probs_NE = probs_NE

        flat_experts = experts_NK.reshape(-1)
        lse2_N = torch.logsumexp(logits_NE, dim=1).square()
        if valid_N is None:
            importance_E = gates_NK.new_zeros(e).index_add(0, flat_experts, gates_NK.reshape(-1))
            count_E = count_per_bin(flat_experts, e, x_ND.dtype)
            prob_sum_E, lse2_sum = probs_NE.sum(0), lse2_N.sum()
            n_tokens_1 = logits_NE.new_full((1,), float(logits_NE.shape[0]))   # a fill, not a copy from the host
        else:   # padding rows weigh 0
            if valid_N.shape != (x_ND.shape[0],):
                raise ValueError(f"valid_N must have shape ({x_ND.shape[0]},), got {tuple(valid_N.shape)}")
            w_N = valid_N.to(x_ND.dtype)
            w_C = w_N.repeat_interleave(k, output_size=w_N.shape[0] * k)
            importance_E = gates_NK.new_zeros(e).index_add(0, flat_experts, gates_NK.reshape(-1) * w_C)
            count_E = w_C.new_zeros(e).index_add_(0, flat_experts, w_C)
            prob_sum_E, lse2_sum, n_tokens_1 = (probs_NE * w_N[:, None]).sum(0), (lse2_N * w_N).sum(), w_N.sum()[None]

        # One collective for everything the global means need.
        stats = self.batch.sum(torch.cat([prob_sum_E, importance_E, count_E, lse2_sum[None], n_tokens_1]))
        prob_sum_E, importance_E, count_E = stats[:e], stats[e : 2 * e], stats[2 * e : 3 * e]
        lse2_sum, n_tokens = stats[3 * e], stats[3 * e + 1]

        l_a = switch_loss(prob_sum_E, count_E.detach())
        l_z = lse2_sum / n_tokens.detach().clamp_min(1.0)
        aux_loss = self.aux_weight * l_a + self.z_weight * l_z
        metrics = {"z_loss": l_z.detach(), "switch_loss": l_a.detach()}   # read at log intervals
        return RouterOutput.from_top_k(gates_NK, experts_NK, aux_loss, importance_E, count_E.detach(), metrics)
