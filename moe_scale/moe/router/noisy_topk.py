"""Noisy top-k gating (Shazeer et al. 2017, eq. 3-5, 8-11; spec §1.2-1.4), as in t2t's ``noisy_top_k_gating``.

Legend (docs/shapes.md): N tokens, D model width, E experts, K experts per token, K1 = min(K+1, E) logits
kept per token (the load estimator needs the (K+1)-th).

The data-parallel sum of the balance statistics (``batch.sum``) and the noise (``noise_sampler``) are injected by
the layer (moe/router/base.py).
"""

import math

import torch
from torch import Tensor, nn

from moe_scale.config import RouterConfig
from moe_scale.moe.router.base import Router, RouterOutput
from moe_scale.moe.router.gating_ops import noisy_top_k
from moe_scale.moe.kernel_policy import count_per_bin
from moe_scale.moe.losses import balance_loss

_FUSED_GATE_MAX_EXPERTS = 16   # w_gate and w_noise multiply x as one matrix up to this many experts


def prob_in_top_k(clean_NE: Tensor, noisy_NE: Tensor, std_NE: Tensor, top_values_NK1: Tensor, k: int) -> Tensor:
    """P(x, i): probability that expert i stays in the top k when only its own noise is redrawn (eq. 8-9).

    The numerator uses the *clean* logit; the thresholds are *noisy* order statistics: the (k+1)-th value for an
    expert that is in the top k, the k-th for one that is not (both equal "the k-th largest of the others").
    ``std_NE`` includes the 1e-2. The thresholds are deliberately not detached (t2t keeps their gradient).
    Needs K1 >= k+1 columns in ``top_values_NK1``, so the caller falls back to a hard count when k == E.
    """
    thr_in_N1 = top_values_NK1[:, k : k + 1]
    thr_out_N1 = top_values_NK1[:, k - 1 : k]
    is_in_NE = noisy_NE > thr_in_N1  # strict, as t2t; equals "in the top k" apart from ties
    denom_NE = math.sqrt(2.0) * std_NE + 1e-20  # 1e-20: at std 0 this becomes a step, never NaN
    p_in_NE = 0.5 * (1.0 + torch.erf((clean_NE - thr_in_N1) / denom_NE))
    p_out_NE = 0.5 * (1.0 + torch.erf((clean_NE - thr_out_N1) / denom_NE))
    return torch.where(is_in_NE, p_in_NE, p_out_NE)


class NoisyTopKRouter(Router):
    """Noisy top-k gate with importance and load CV² losses.

    Both gating matrices start at zero (paper App. A), so at init routing is uniformly random (noise only, std
    softplus(0) + 1e-2 = 0.703147) and the expected load is balanced.

    k == 1 caveat: the softmax over a single kept logit is the constant 1, so the task loss gives ``w_gate`` no
    gradient; only the balancing losses train the router. The paper uses k >= 2 for every LM/MT model.

    ``batch.sum`` must be an autograd-aware all-reduce(SUM) over the data-parallel group in multi-process runs
    (a detached one shrinks the router gradient by world_size). It is called exactly once per forward, on the
    stacked ``[2, E]`` (importance, load), so it costs one collective, and it is called on every rank even when the
    rank has no tokens, so collectives stay matched.

    With ``noisy=False`` ``w_noise`` still exists (one parameter layout for every config) but gets no gradient,
    and ``w_gate`` starts from small random values instead of zeros: without noise, zero logits tie everywhere and
    top-k would send every token to the same k experts.
    """

    name = "noisy_topk"

    @classmethod
    def gating_counts(cls, config, d_model, num_experts):
        return 2 * d_model * num_experts, 2 * d_model * num_experts   # W_g and W_noise [D, E]

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        k: int,
        w_importance: float = 0.1,
        w_load: float = 0.1,
        noisy: bool = True,
        noise_epsilon: float = 1e-2,
    ):
        super().__init__(d_model, num_experts, k)
        self.w_importance, self.w_load = w_importance, w_load
        self.noisy, self.noise_epsilon = noisy, noise_epsilon
        # Names avoid the substring "expert": DeepSpeed's checkpointing treats such names as expert weights.
        self.w_gate = nn.Parameter(torch.zeros(d_model, num_experts))
        self.w_noise = nn.Parameter(torch.zeros(d_model, num_experts))
        if not noisy:
            self.small_init_(self.w_gate, d_model)

    @classmethod
    def from_config(cls, config: RouterConfig, d_model: int, num_experts: int, ep_size: int = 1,
                    ep_rank: int = 0) -> "NoisyTopKRouter":
        return cls(d_model, num_experts, config.top_k, w_importance=config.w_importance, w_load=config.w_load,
                   noisy=config.noisy_gating)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_experts={self.num_experts}, k={self.k}, noisy={self.noisy}, "
            f"w_importance={self.w_importance}, w_load={self.w_load}"
        )

    def _gate_and_noise_logits(self, x_ND: Tensor) -> tuple[Tensor, Tensor]:
        """(x @ w_gate, x @ w_noise). With few experts, as one product with both matrices side by side (a
        product 8 columns wide runs far below the speed of a wider one); from 32 experts on, apart (no copies)."""
        e = self.num_experts
        if e > _FUSED_GATE_MAX_EXPERTS:
            return self.logits(x_ND, self.w_gate), self.logits(x_ND, self.w_noise)
        both_N2E = self.logits(x_ND, torch.cat([self.w_gate, self.w_noise], dim=1))
        return both_N2E[:, :e].contiguous(), both_N2E[:, e:].contiguous()

    def route(self, x_ND: Tensor) -> RouterOutput:
        """Noisy logits, top-k and the smooth load (eq. 8-9) in the memory-lean fused op."""
        k, e = self.k, self.num_experts
        noisy = self.training and self.noisy
        if noisy:
            clean_NE, raw_noise_NE = self._gate_and_noise_logits(x_ND)
            noise_NE = self._sample_noise(*clean_NE.shape, x_ND.device).to(x_ND.dtype)
            top_values_NK1, top_idx_NK1, smooth_load_E = noisy_top_k(
                clean_NE, raw_noise_NE, noise_NE, self.noise_epsilon, k, smooth_load=k < e)
        else:
            top_values_NK1, top_idx_NK1 = self.logits(x_ND, self.w_gate).topk(min(k + 1, e), dim=1)  # values keep
        gates_NK = torch.softmax(top_values_NK1[:, :k], dim=1)                                      # their gradient
        experts_NK = top_idx_NK1[:, :k].contiguous()   # (once: the importance and the pairs read it flat)

        # importance_E = sum over tokens of the dense gates, without building the dense [N, E] gates.
        importance_E = gates_NK.new_zeros(e).index_add(0, experts_NK.reshape(-1), gates_NK.reshape(-1))
        if noisy and k < e:
            load_E = smooth_load_E
        else:  # eval, noise off, or k == E (no (k+1)-th value): a count, with no gradient
            load_E = count_per_bin(experts_NK, e, gates_NK.dtype)

        # Balance over the whole data-parallel batch: one collective for both statistics.
        stats_2E = self.batch.sum(torch.stack([importance_E, load_E]))
        aux_loss = balance_loss(stats_2E, (self.w_importance, self.w_load))
        return RouterOutput.from_top_k(gates_NK, experts_NK, aux_loss, stats_2E[0], stats_2E[1],
                                       local_gates_E=importance_E.detach())
