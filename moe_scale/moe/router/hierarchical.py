"""Two-level hierarchical noisy top-k gate (Shazeer et al. 2017, Appendix B, eq. 12-14; spec §1.6, §7 item 7).

Legend (docs/shapes.md): N tokens, D model width, A groups (``a``), G experts per group (``b``), E = A*G experts,
Kp / Ks top-k of the primary / secondary gate, K = Kp*Ks experts per token, J = N*Kp (token, chosen group) rows,
M = top-(k+1) kept logits.

A primary noisy top-k gate picks Kp of the A groups for each token; for each picked group i a secondary noisy top-k
gate with group i's own weights picks Ks of its G experts. Expert (i, j) gets the gate ``G_p[t,i] * G_s[t,i,j]``
(eq. 12) and the flat global id ``i*G + j``, so the G experts of a group are contiguous and live on one
expert-parallel rank whenever ep_size divides A.

Placement: the primary gate is data-parallel, as in the paper; the secondary gates are replicated and evaluated
on the token's own rank, but only for the groups the token picked: the J = N*Kp (token, group) rows are sorted by
group and multiplied with their group's matrices in one grouped GEMM (moe/experts/grouped_gemm.py), so the gate
costs N*(A + Kp*G)*D multiply-adds and N*(A + Kp*G) floats per matrix, never N*E (the paper's count, which
`moe-scale flops` uses). A token crosses the network once, straight to the rank that holds its group's experts.
The paper keeps each secondary gate beside its group's experts instead; here the A*D*G*2 secondary parameters
are replicated on every rank (the planner counts them).
"""

import math
from typing import Optional

import torch
from torch import Tensor, nn

from moe_scale.moe.experts.grouped_gemm import GroupLayout, per_expert_outer, rows_times_expert
from moe_scale.moe.kernel_policy import count_per_bin
from moe_scale.moe.losses import cv_squared
from moe_scale.moe.router.gating_ops import noisy_top_k
from moe_scale.moe.router.base import Router, RouterOutput

_EPS = 1e-10  # t2t's epsilon in eq. 14's denominator: a group that got no token has load 0, not NaN


class _PickedGroupProduct(torch.autograd.Function):
    """out[j] = x[row_J[j]] @ w[group of row j] for J rows sorted by group (`layout` holds the rows per group):
    [J, G]. One grouped GEMM forward, two backward (dx, dw), whatever the number of groups."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, w_ADG: Tensor, row_J: Tensor, layout: GroupLayout) -> Tensor:
        ctx.save_for_backward(x_ND, w_ADG, row_J)
        ctx.layout = layout
        return rows_times_expert(x_ND, w_ADG, layout, a_index_M=row_J)

    @staticmethod
    def backward(ctx, grad_JG: Tensor):
        x_ND, w_ADG, row_J = ctx.saved_tensors
        grad_JG = grad_JG.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.zeros_like(x_ND).index_add_(0, row_J, rows_times_expert(grad_JG, w_ADG.transpose(1, 2),
                                                                                   ctx.layout))
        if ctx.needs_input_grad[1]:
            grad_w = per_expert_outer(x_ND.index_select(0, row_J), grad_JG, ctx.layout)
        return grad_x, grad_w, None, None


def _top_k(clean_RC: Tensor, raw_noise_RC: Optional[Tensor], noise_RC: Optional[Tensor], k: int, eps: float,
           row_group_R: Optional[Tensor] = None, num_groups: int = 0):
    """Noisy (with noise given) or clean top-k gating of R rows over C choices: (gates_RK, idx_RK, load). The
    load is the smooth in-top-k probability (eq. 8-9) summed over rows (per group of rows with `row_group_R`),
    computed in the memory-lean fused op; None without noise or when k == C (the caller counts instead)."""
    c = clean_RC.shape[1]
    if noise_RC is None:
        top_values_RM, top_idx_RM = clean_RC.topk(min(k + 1, c), dim=1)
        load = None
    else:
        top_values_RM, top_idx_RM, load = noisy_top_k(clean_RC, raw_noise_RC, noise_RC, eps, k, k < c,
                                                       row_group_R, num_groups)
        load = load if k < c else None
    return torch.softmax(top_values_RM[:, :k], dim=1), top_idx_RM[:, :k], load


class HierarchicalRouter(Router):
    """Hierarchical MoE gate with Importance_H / Load_H CV² losses over all A*G experts (eq. 13-14).

    Exactly as t2t's ``DistributedMixtureOfExperts`` hierarchical branch (spec §1.6):

    - ``importance_E[i*G+j] = Σ_t G_p[t,i] · G_s[t,i,j]`` (eq. 13);
    - ``load_E[i*G+j] = load_p[i] · load_s[i,j] / (cnt_p[i] + 1e-10)`` (eq. 14), where ``load_p`` is the primary
      smooth load (hard count in eval, without noise, or when Kp == A), ``load_s[i]`` the secondary smooth load
      (or hard count) of group i over the tokens that picked it, *not* multiplied by ``G_p``, and ``cnt_p[i]`` the
      hard count of tokens that picked group i.

    Data parallelism: ``load_p``, ``load_s`` and ``cnt_p`` are summed over the data-parallel batch before eq. 14 is
    formed (the ratio of sums, not the sum of ratios), together with the importance: ``sum_over_batch`` is called
    exactly once per forward, on the concatenation ``[importance (E), load_s (E), load_p (A), cnt_p (A)]``, and on
    every rank even when it has no tokens. It must be an autograd-aware all-reduce(SUM).

    Noise: ``noise_sampler`` (default ``torch.randn``) is called exactly twice per training forward with noise on:
    first ``(N, A)`` for the primary, then ``(N, Kp*G)`` for the secondary (row t, columns s*G..s*G+G-1: the
    noise of token t's s-th picked group, in the primary's top-k order), so ``GlobalTokenNoise`` keeps a
    1-process run equal to an N-process run.

    Initialisation as the flat gate: all four matrices start at zero (noise std 0.703147 at both levels, balanced
    expected load); with ``noisy=False`` the ``w_gate_*`` start from small random values so top-k doesn't tie.
    Computed in float32 at least (float64 stays float64), with autocast off.
    """

    def __init__(
        self,
        d_model: int,
        num_groups: int,
        experts_per_group: int,
        k_primary: int = 2,
        k_secondary: int = 2,
        w_importance: float = 0.1,
        w_load: float = 0.1,
        noisy: bool = True,
        noise_epsilon: float = 1e-2,
    ):
        a, b = num_groups, experts_per_group
        if a < 1 or b < 1:
            raise ValueError(f"hierarchical router needs num_groups >= 1 and experts_per_group >= 1, got {a} and {b}")
        if not 1 <= k_primary <= a:
            raise ValueError(f"hierarchical router: k_primary must be in [1, num_groups={a}], got {k_primary}")
        if not 1 <= k_secondary <= b:
            raise ValueError(
                f"hierarchical router: k_secondary must be in [1, experts_per_group={b}], got {k_secondary}"
            )
        super().__init__(d_model, a * b, k_primary * k_secondary)   # k: experts per token
        self.num_groups, self.experts_per_group = a, b
        self.k_primary, self.k_secondary = k_primary, k_secondary
        self.w_importance, self.w_load = w_importance, w_load
        self.noisy, self.noise_epsilon = noisy, noise_epsilon
        # Names avoid the substring "expert": DeepSpeed's checkpointing treats such names as expert weights.
        self.w_gate_primary = nn.Parameter(torch.zeros(d_model, a))
        self.w_noise_primary = nn.Parameter(torch.zeros(d_model, a))
        self.w_gate_secondary = nn.Parameter(torch.zeros(a, d_model, b))
        self.w_noise_secondary = nn.Parameter(torch.zeros(a, d_model, b))
        if not noisy:
            nn.init.normal_(self.w_gate_primary, std=1e-2 / math.sqrt(d_model))
            nn.init.normal_(self.w_gate_secondary, std=1e-2 / math.sqrt(d_model))

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_groups={self.num_groups}, experts_per_group={self.experts_per_group}, "
            f"k_primary={self.k_primary}, k_secondary={self.k_secondary}, noisy={self.noisy}, "
            f"w_importance={self.w_importance}, w_load={self.w_load}"
        )

    def forward(self, x_ND: Tensor) -> RouterOutput:
        a, b, kp, ks = self.num_groups, self.experts_per_group, self.k_primary, self.k_secondary
        n = x_ND.shape[0]
        noisy = self.training and self.noisy
        dtype = torch.promote_types(x_ND.dtype, torch.float32)
        with torch.autocast(device_type=x_ND.device.type, enabled=False):
            x_ND = x_ND.to(dtype)

            # ---- primary: noisy top-kp over the A groups
            clean_NA = x_ND @ self.w_gate_primary.to(dtype)
            raw_NA = x_ND @ self.w_noise_primary.to(dtype) if noisy else None
            noise_NA = self._sample_noise(n, a, x_ND.device).to(dtype) if noisy else None
            gp_NKp, groups_NKp, load_p_A = _top_k(clean_NA, raw_NA, noise_NA, kp, self.noise_epsilon)
            groups_J = groups_NKp.reshape(-1)  # J = N*Kp (token, chosen group) rows, token-major
            counts_A = count_per_bin(groups_J, a)  # |X^(i)|
            cnt_A = counts_A.to(dtype)
            if load_p_A is None:  # eval, noise off, or Kp == A: the hard count
                load_p_A = cnt_A

            # ---- secondary: each (token, picked group) row times that group's matrices, rows sorted by group
            order_J = torch.argsort(groups_J, stable=True)
            layout = GroupLayout(counts_A, x_ND)
            row_J = order_J // kp   # the token of each sorted row

            pad = -b % (16 // x_ND.element_size()) if layout.kernel in ("grouped", "triton") else 0

            def picked(w_ADG: Tensor) -> Tensor:
                w_ADG = w_ADG.to(dtype)
                if pad:   # grouped GEMMs read rows 16-byte aligned: zero columns up to the next multiple
                    w_ADG = nn.functional.pad(w_ADG, (0, pad))
                sorted_JG = _PickedGroupProduct.apply(x_ND, w_ADG, row_J, layout)[:, :b]
                return sorted_JG.new_empty(sorted_JG.shape).index_copy(0, order_J, sorted_JG)   # token-major again

            clean_JG = picked(self.w_gate_secondary)
            raw_JG = picked(self.w_noise_secondary) if noisy else None
            noise_JG = self._sample_noise(n, kp * b, x_ND.device).to(dtype).reshape(n * kp, b) if noisy else None
            # Load_i(X^(i)): the secondary smooth load summed per group, NOT multiplied by G_p
            gs_JKs, local_JKs, load_s_AG = _top_k(clean_JG, raw_JG, noise_JG, ks, self.noise_epsilon, groups_J, a)
            if load_s_AG is None:
                load_s_AG = count_per_bin(groups_J[:, None] * b + local_JKs, a * b, dtype).reshape(a, b)

            # ---- combined gates G_p·G_s (eq. 12) and flat expert ids i*G + j; the primary gate is applied here once
            gates_NK = (gp_NKp.reshape(-1, 1) * gs_JKs).reshape(n, kp * ks)
            experts_NK = (groups_J[:, None] * b + local_JKs).reshape(n, kp * ks)
            importance_E = gates_NK.new_zeros(a * b).index_add(0, experts_NK.reshape(-1), gates_NK.reshape(-1))

            # ---- one collective for everything, then eq. 14 from the global sums
            stats = self.sum_over_batch(torch.cat([importance_E, load_s_AG.reshape(-1), load_p_A, cnt_A]))
            importance_E, load_s_AG, load_p_A, cnt_A = stats.split([a * b, a * b, a, a])
            load_E = (load_p_A[:, None] * load_s_AG.reshape(a, b) / (cnt_A[:, None] + _EPS)).reshape(-1)
            cv2_2 = cv_squared(torch.stack([importance_E, load_E]))
            aux_loss = self.w_importance * cv2_2[0] + self.w_load * cv2_2[1]
        return RouterOutput(gates_NK, experts_NK, aux_loss, importance_E, load_E)
