"""Strictly balanced gating (Shazeer et al. 2017, App. F, eq. 15-20; spec §1.7).

Legend (docs/shapes.md): N tokens on this rank, D model width, E experts (n in the paper), Nb tokens of the
batch in scope (this rank's for ``scope="local"``, the whole data-parallel batch's for ``scope="global"``),
C selected (token, expert) pairs.

Training routes with ``M_batchwise``: every expert takes its top ``m = max(1, floor(k * Nb_valid / E))`` tokens of
the batch in scope (columns of ``S = softmax(x W_g)``), so every expert gets exactly ``m`` tokens while a token may
get 0 experts (its MoE output is 0) or more than k. Inference routes with ``M_threshold = S > T`` and learned
thresholds ``T [E]``, which the threshold loss ``L_bw`` (eq. 20) trains to reproduce the batchwise mask.
The data-parallel sum and row gather (``batch``) are injected by the layer (moe/router/base.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from moe_scale.moe.losses import balance_loss
from moe_scale.config import BatchwiseConfig, RouterConfig, choices
from moe_scale.moe.router.base import Router, RouterOutput

_MASK32 = 0xFFFFFFFF


def _hash32(h: Tensor) -> Tensor:
    """A 32-bit integer mix (int64 tensors holding values in [0, 2^32); products stay below 2^59: no overflow)."""
    h = (((h >> 16) ^ h) * 0x45D9F3B) & _MASK32
    h = (((h >> 16) ^ h) * 0x45D9F3B) & _MASK32
    return (h >> 16) ^ h


def selection_keys(s_NbE: Tensor, valid_Nb: Tensor, row0: int = 0) -> Tensor:
    """int64 [Nb, E] keys whose order is the order of ``s_NbE`` with exact ties broken pseudo-randomly.

    key = (float32 bits of S) << 31 | hash31(row0 + row, column). The float32 bit pattern of a non-negative float is
    monotone in its value, so distinct scores keep their order exactly and only *equal* scores are ordered by the
    hash: a jitter smaller than any float32 difference, applied to the selection scores only. The hash depends on
    the row's index in the batch in scope and on the column, so (a) at zero init, where every S equals 1/E, each
    expert takes a different pseudo-random set of m rows instead of the same first m (spec §1.7 zero-init
    pitfall), and (b) every rank and a 1-process run on the same global batch break ties identically.
    Invalid (padding) rows get key -1 so they never take capacity.
    """
    b, e = s_NbE.shape
    bits_NbE = s_NbE.detach().float().abs().view(torch.int32).long()  # abs: also maps -0.0 to 0
    rows_Nb = torch.arange(row0, row0 + b, device=s_NbE.device) & _MASK32
    cols_E = torch.arange(e, device=s_NbE.device)
    tie_NbE = _hash32(_hash32(rows_Nb)[:, None] ^ cols_E[None, :]) & 0x7FFFFFFF
    return ((bits_NbE << 31) | tie_NbE).masked_fill(~valid_Nb[:, None], -1)


def batchwise_mask(s_NbE: Tensor, m: int, valid_Nb: Tensor, row0: int = 0) -> Tensor:
    """M_batchwise (eq. 18): 1 where S[j, i] is among the top m valid rows of column i (ties: ``selection_keys``)."""
    mask_NbE = torch.zeros_like(s_NbE, dtype=torch.bool)
    if m > 0:
        idx_mE = selection_keys(s_NbE, valid_Nb, row0).topk(m, dim=0).indices
        mask_NbE.scatter_(0, idx_mE, True)
    return mask_NbE


def tokens_per_expert(k: int, num_valid_rows: int, num_experts: int) -> int:
    """m = max(1, floor(k * Nb_valid / n)), and 0 for an empty batch (m <= Nb_valid always since k <= n)."""
    if num_valid_rows == 0:
        return 0
    return max(1, (k * num_valid_rows) // num_experts)


def midpoint_thresholds(s_NbE: Tensor, m: int, valid_Nb: Tensor) -> Tensor:
    """[E]: per column, the midpoint between the m-th and (m+1)-th largest valid S (minimizer of L_bw on this
    batch). With m == Nb_valid there is no (m+1)-th value: midpoint between the m-th value and 0."""
    s_NbE = s_NbE.detach().masked_fill(~valid_Nb[:, None], -math.inf)
    num_valid = int(valid_Nb.sum())
    top_vals = s_NbE.topk(min(m + 1, s_NbE.shape[0]), dim=0).values
    below_E = top_vals[m] if m < num_valid else torch.zeros_like(top_vals[0])
    return 0.5 * (top_vals[m - 1] + below_E)


class BatchwiseRouter(Router):
    """Strictly balanced gate (App. F) with learned thresholds for inference.

    Parameters: ``w_gate [D, E]`` (no bias) and ``thresholds [E]`` (names avoid "expert": DeepSpeed treats such
    names as expert weights). ``thresholds`` is an ordinary parameter trained by the main optimizer through
    ``L_bw``; keep weight decay off it. Buffer ``thresholds_initialized`` (saved in the state dict) records that T
    was set from a batch.

    Choices the paper leaves open (spec §1.7), all documented here:

    * No noise. S = softmax(x W_g) in float32 (float64 stays float64).
    * Ties: ``w_gate`` starts from small random values (std 1e-2/sqrt(D)) so S is almost surely tie-free, *and*
      exact ties (zero init, duplicated tokens) are broken by a hash of (row, column) in ``selection_keys``,
      which never reorders distinct scores and is identical on every rank.
    * ``scope="local"`` (default): top-m over this rank's batch; each expert gets exactly ``m_local`` tokens from each
      rank, no communication. ``scope="global"``: S (detached) is gathered over the data-parallel group
      (``batch.gather``), top-m is taken over the global batch and this rank keeps its rows, so each expert gets
      exactly ``m`` tokens of the *global* batch.
    * Threshold loss ``L_bw = Σ_j Σ_i (M_thr − M_b)(S.detach() − T)`` (eq. 20), training only; its gradient wrt
      ``T_i`` is ``Σ_j (M_b − M_thr)_{j,i}``. ``threshold_reduction="mean"`` (default) divides by this rank's number
      of valid rows; ``"sum"`` is the paper's raw double sum. ``detach_scores=False`` lets L_bw reach W_g too.
    * T init: ``1/E`` (S at zero init); with ``init_thresholds_from_batch`` (default), the first training batch
      sets T to the midpoint between the m-th and (m+1)-th largest S per column of the batch in scope, so
      the two masks agree on that batch. With ``scope="local"`` the per-rank midpoints are averaged over ranks
      (weighted by valid rows, one extra ``batch.sum`` call, first batch only) so T stays replicated.
    * Eval: ``M_threshold = S > T``; a row with no expert above its threshold falls back to its argmax expert with
      gate 1 (the paper is silent; the alternative would be a zero MoE output).
    * Training: a token may get no expert; its gate row is 0 (denominator clamped, no NaN) and its output is 0.
    * Balancing: ``L_importance = w_importance · cv2(importance)``, importance = Σ_tokens G over the whole
      data-parallel batch. ``L_load`` is not used: under M_batchwise the true load is exactly m per expert and
      there is no noise, so the load loss is zero/undefined (spec §1.7). ``load_E`` is still reported as the hard
      count of selections (with importance and the metric counts in a single ``batch.sum`` call).
    * Metrics (whole data-parallel batch): ``threshold_agreement`` = fraction of valid (token, expert) decisions
      with M_threshold == M_batchwise on the current batch, in training and eval (at eval M_batchwise is computed
      on the eval batch for this comparison only; 1.0 for an empty batch); ``tokens_without_expert`` = fraction of
      valid tokens whose routing mask is empty (training) or that needed the fallback (eval);
      ``tokens_per_expert`` = m; ``threshold_loss`` = this rank's L_bw (training).
    """

    takes_valid_rows = True

    name, section = "batchwise", "batchwise"
    k_per_token = False

    @classmethod
    def gating_counts(cls, config, d_model, num_experts):
        return d_model * num_experts + num_experts, d_model * num_experts   # W_g [D, E] (no noise), thresholds [E]

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        k: int,
        w_importance: float = 0.01,
        threshold_loss_weight: float = 1.0,
        threshold_reduction: str = "mean",
        scope: str = "local",
        detach_scores: bool = True,
        init_thresholds_from_batch: bool = True,
    ):
        super().__init__(d_model, num_experts, k)
        if threshold_reduction not in choices(BatchwiseConfig, "threshold_reduction"):
            raise ValueError(f"threshold_reduction must be 'mean' or 'sum', got {threshold_reduction!r}")
        if scope not in choices(BatchwiseConfig, "scope"):
            raise ValueError(f"batchwise router scope must be 'local' or 'global', got {scope!r}")
        self.w_importance, self.threshold_loss_weight = w_importance, threshold_loss_weight
        self.threshold_reduction, self.scope = threshold_reduction, scope
        self.detach_scores, self.init_thresholds_from_batch = detach_scores, init_thresholds_from_batch
        self.w_gate = nn.Parameter(torch.empty(d_model, num_experts))
        self.small_init_(self.w_gate, d_model)
        self.thresholds = nn.Parameter(torch.full((num_experts,), 1.0 / num_experts))
        self.register_buffer("thresholds_initialized", torch.zeros((), dtype=torch.bool))

    @classmethod
    def from_config(cls, config: RouterConfig, d_model: int, num_experts: int, ep_size: int = 1,
                    ep_rank: int = 0) -> "BatchwiseRouter":
        b = config.batchwise
        return cls(d_model, num_experts, config.top_k, w_importance=config.w_importance,
                   threshold_reduction=b.threshold_reduction, scope=b.scope)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_experts={self.num_experts}, k={self.k}, scope={self.scope}, "
            f"w_importance={self.w_importance}, threshold_loss_weight={self.threshold_loss_weight}, "
            f"threshold_reduction={self.threshold_reduction}, detach_scores={self.detach_scores}"
        )

    def _batchwise_in_scope(self, s_NE: Tensor, valid_N: Tensor) -> tuple[Tensor, int, Tensor, Tensor]:
        """(this rank's rows of M_batchwise [N, E] bool, m, S of the batch in scope, its valid rows)."""
        n = s_NE.shape[0]
        if self.scope == "local":
            m = tokens_per_expert(self.k, int(valid_N.sum()), self.num_experts)
            return batchwise_mask(s_NE, m, valid_N), m, s_NE, valid_N
        gathered, offset = self.batch.gather(torch.cat([s_NE.detach(), valid_N[:, None].to(s_NE.dtype)], dim=1))
        s_NbE, valid_Nb = gathered[:, :-1], gathered[:, -1] > 0.5
        m = tokens_per_expert(self.k, int(valid_Nb.sum()), self.num_experts)
        return batchwise_mask(s_NbE, m, valid_Nb)[offset : offset + n], m, s_NbE, valid_Nb

    @torch.no_grad()
    def _init_thresholds(self, s_NbE: Tensor, m: int, valid_Nb: Tensor) -> None:
        num_valid = int(valid_Nb.sum())
        t_E = midpoint_thresholds(s_NbE, m, valid_Nb).to(self.thresholds.dtype) if m > 0 else None
        if self.scope == "local":  # average the per-rank midpoints so T stays identical on every rank
            weight = float(num_valid)
            local = torch.zeros(self.num_experts + 1, dtype=self.thresholds.dtype, device=s_NbE.device)
            if t_E is not None:
                local[:-1] = t_E * weight
            local[-1] = weight
            total = self.batch.sum(local)
            if float(total[-1]) <= 0:
                return  # no valid row anywhere: try again next batch (same decision on every rank)
            t_E = total[:-1] / total[-1]
        elif t_E is None:
            return
        self.thresholds.copy_(t_E)
        self.thresholds_initialized.fill_(True)

    def route(self, x_ND: Tensor, valid_N: Optional[Tensor] = None) -> RouterOutput:
        """``valid_N`` (bool [N], optional): False for padding rows, which take no capacity, get no expert and
        count in no statistic."""
        n = x_ND.shape[0]
        valid_N = torch.ones(n, dtype=torch.bool, device=x_ND.device) if valid_N is None else valid_N.bool()
        if valid_N.shape != (n,):
            raise ValueError(f"valid_N must have shape ({n},), got {tuple(valid_N.shape)}")
        s_NE = torch.softmax(self.logits(x_ND, self.w_gate), dim=-1)  # G_sigma (eq. 15)

        # M_batchwise routes in training; at eval it is computed only for the agreement metric.
        m_b_NE, m, s_NbE, valid_Nb = self._batchwise_in_scope(s_NE, valid_N)
        if self.training and self.init_thresholds_from_batch and not bool(self.thresholds_initialized):
            self._init_thresholds(s_NbE, m, valid_Nb)
        t_E = self.thresholds.to(x_ND.dtype)
        m_thr_NE = (s_NE.detach() > t_E.detach()[None, :]) & valid_N[:, None]  # M_threshold (eq. 19)
        mask_NE, empty_N = self._routing_mask(s_NE, m_b_NE, m_thr_NE, valid_N)

        sm_NE = s_NE * mask_NE.to(x_ND.dtype)
        g_NE = sm_NE / sm_NE.sum(-1, keepdim=True).clamp_min(torch.finfo(x_ND.dtype).tiny)  # eq. 16; empty row: 0
        aux_loss, importance_E, load_E, metrics = self._balance(g_NE, mask_NE, (m_thr_NE == m_b_NE), valid_N,
                                                                empty_N, m)
        if self.training:  # threshold loss (eq. 20): trains T (and W_g only if detach_scores=False)
            l_bw = self._threshold_loss(s_NE, t_E, m_thr_NE, m_b_NE, valid_N)
            aux_loss = aux_loss + self.threshold_loss_weight * l_bw
            metrics["threshold_loss"] = float(l_bw.detach())

        token_C, expert_C = mask_NE.nonzero(as_tuple=True)
        return RouterOutput(token_C, expert_C, g_NE[token_C, expert_C], aux_loss, importance_E, load_E, metrics)

    def _routing_mask(self, s_NE: Tensor, m_b_NE: Tensor, m_thr_NE: Tensor, valid_N: Tensor) -> tuple[Tensor, Tensor]:
        """(the mask that routes, the valid tokens it gives no expert): M_batchwise in training; at eval
        M_threshold, where a row above no threshold falls back to its argmax expert (gate 1)."""
        if self.training:
            return m_b_NE, valid_N & ~m_b_NE.any(dim=1)
        empty_N = valid_N & ~m_thr_NE.any(dim=1)
        fallback_NE = torch.zeros_like(m_thr_NE).scatter_(1, s_NE.detach().argmax(1, keepdim=True), True)
        return m_thr_NE | (fallback_NE & empty_N[:, None]), empty_N

    def _balance(self, g_NE: Tensor, mask_NE: Tensor, agree_NE: Tensor, valid_N: Tensor, empty_N: Tensor, m: int):
        """(aux_loss, importance_E, load_E, metrics) over the whole data-parallel batch: one collective."""
        e, dtype = self.num_experts, g_NE.dtype
        agree = (agree_NE & valid_N[:, None]).sum().to(dtype)
        counts_3 = torch.stack([agree, valid_N.sum().to(dtype) * e, empty_N.sum().to(dtype)])
        stats = self.batch.sum(torch.cat([g_NE.sum(0), mask_NE.sum(0).to(dtype), counts_3]))
        importance_E, load_E = stats[:e], stats[e : 2 * e]
        agree_g, decisions_g, empty_g = stats[2 * e :].detach().tolist()
        metrics = {
            "threshold_agreement": agree_g / decisions_g if decisions_g > 0 else 1.0,
            "tokens_without_expert": empty_g * e / decisions_g if decisions_g > 0 else 0.0,
            "tokens_per_expert": float(m),
        }
        return balance_loss(importance_E[None], (self.w_importance,)), importance_E, load_E, metrics

    def _threshold_loss(self, s_NE: Tensor, t_E: Tensor, m_thr_NE: Tensor, m_b_NE: Tensor, valid_N: Tensor):
        """L_bw = Σ_j Σ_i (M_thr − M_b)(S − T) over valid rows (eq. 20), divided by the valid rows for "mean"."""
        dtype = s_NE.dtype
        s_used_NE = s_NE.detach() if self.detach_scores else s_NE
        diff_NE = (m_thr_NE.to(dtype) - m_b_NE.to(dtype)) * valid_N[:, None].to(dtype)
        l_bw = (diff_NE * (s_used_NE - t_E[None, :])).sum()
        if self.threshold_reduction == "mean":
            l_bw = l_bw / max(int(valid_N.sum()), 1)
        return l_bw
