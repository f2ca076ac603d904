"""Two-level hierarchical noisy top-k gate (Shazeer et al. 2017, Appendix B, eq. 12-14; spec §1.6, §7 item 7).

Legend (docs/shapes.md): N tokens, D model width, A groups (``a``), G experts per group (``b``), E = A*G
experts, Kp primary k (groups per token), Ks secondary k (experts per chosen group), K = Kp*Ks experts per token,
J = N*Kp (token, chosen group) rows, M (token, group) pairs that arrive at this rank's groups (sorted by group),
R rows that arrive here.

A primary noisy top-k gate picks Kp of the A groups for each token; for each picked group i a secondary noisy top-k
gate with group i's own weights picks Ks of its G experts. Expert (i, j) gets the gate ``G_p[t,i] * G_s[t,i,j]``
(eq. 12) and the flat global id ``i*G + j``, so the G experts of a group are contiguous and live on one
expert-parallel rank whenever ep_size divides A.

Placement (the paper's): the primary gate is data-parallel; each group's secondary gate lives beside the group's
experts, sharded over the expert-parallel ranks like them (a rank holds the secondary matrices of its A/P groups,
[A/P, D, G] each; ExpertParallelModule checkpoints column j of group i with expert i*G + j). HierarchicalMoELayer sends
each (token, picked group) row to the group's rank once (`route_groups`), where the J = N*Kp rows are already
sorted by group and multiplied with their group's matrices in one grouped GEMM (`route_within_groups`), so the
gate costs N*(A + Kp*G)*D multiply-adds and N*(A + Kp*G) floats per matrix, never N*E (the paper's count, which
`moe-scale flops` uses). `balance` forms eq. 13-14 from the data-parallel sums. `forward` runs all three on one
rank (every group local) and returns the usual RouterOutput.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from moe_scale.distributed.comm import copies_over
from moe_scale.moe.experts.grouped_gemm import GroupLayout, per_expert_outer, rows_times_expert
from moe_scale.moe.kernel_policy import count_per_bin
from moe_scale.moe.losses import balance_loss
from moe_scale.moe.router.gating_ops import noisy_top_k
from moe_scale.config import RouterConfig
from moe_scale.moe.router.base import Router, RouterOutput, gating_precision
from moe_scale.moe.router.noise import sample_noise

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


def _top_k(clean: Tensor, raw_noise: Optional[Tensor], noise: Optional[Tensor], k: int, eps: float,
           row_group: Optional[Tensor] = None, num_groups: int = 0):
    """Noisy (with noise given) or clean top-k gating of rows over choices (``clean`` [rows, choices]):
    (gates, idx, load). The load is the smooth in-top-k probability (eq. 8-9) summed over rows (per group of rows
    with `row_group`), computed in the memory-lean fused op; None without noise or when k is the number of choices
    (the caller counts instead)."""
    c = clean.shape[1]
    if noise is None:
        top_values, top_idx = clean.topk(min(k + 1, c), dim=1)
        load = None
    else:
        top_values, top_idx, load = noisy_top_k(clean, raw_noise, noise, eps, k, k < c, row_group, num_groups)
        load = load if k < c else None
    return torch.softmax(top_values[:, :k], dim=1), top_idx[:, :k], load


@dataclass
class GroupRoute:
    """The primary gate's choice for this rank's N tokens: J = N*Kp (token, group) rows, token-major."""

    gates_J: Tensor    # G_p(x)_i of each row
    groups_J: Tensor   # int64 group i of each row
    load_A: Tensor     # Load(X)_i over this rank's tokens: smooth with noise in training, else the hard count
    count_A: Tensor    # |X^(i)| over this rank's tokens


@dataclass
class WithinGroups:
    """The secondary gates' choice for M (token, group) rows of this rank's groups, sorted by group."""

    gates_MKs: Tensor       # G_p * G_s, each expert's gate (eq. 12)
    experts_MKs: Tensor     # local expert ids group*G + j, the group counted among this rank's groups
    importance_aG: Tensor   # Σ G_p G_s per local expert over these rows (eq. 13's terms)
    load_aG: Tensor         # Load_i(X^(i))_j per local group over these rows (smooth, or the hard count)


class HierarchicalRouter(Router):
    """Hierarchical MoE gate with Importance_H / Load_H CV² losses over all A*G experts (eq. 13-14).

    Exactly as t2t's ``DistributedMixtureOfExperts`` hierarchical branch (spec §1.6):

    - ``importance_E[i*G+j] = Σ_t G_p[t,i] · G_s[t,i,j]`` (eq. 13);
    - ``load_E[i*G+j] = load_p[i] · load_s[i,j] / (cnt_p[i] + 1e-10)`` (eq. 14), where ``load_p`` is the primary
      smooth load (hard count in eval, without noise, or when Kp == A), ``load_s[i]`` the secondary smooth load
      (or hard count) of group i over the tokens that picked it, *not* multiplied by ``G_p``, and ``cnt_p[i]`` the
      hard count of tokens that picked group i.

    Data parallelism: ``load_p``, ``load_s`` and ``cnt_p`` are summed over the data-parallel batch before eq. 14 is
    formed (the ratio of sums, not the sum of ratios), together with the importance: ``batch.sum`` is called
    exactly once per forward, on the concatenation ``[importance (E), load_s (E), load_p (A), cnt_p (A)]`` (a rank
    fills the entries of its own groups), and on every rank even when it has no tokens. It must be an
    autograd-aware all-reduce(SUM).

    Noise: ``noise_sampler`` (default: the global RNG) is called exactly twice per training forward with noise on:
    first ``(N, A)`` for the primary, then ``(M, G)`` for the M (token, group) rows the secondary gates score, in
    the order they arrive (sorted by group). A sampler with ``rows``/``first_row`` (``GlobalTokenNoise``) gives
    row (token t, its s-th picked group) the noise of global row ``first_row(N*Kp) + t*Kp + s`` wherever it is
    scored, so a 1-process run equals an N-process run.

    Initialisation as the flat gate: all four matrices start at zero (noise std 0.703147 at both levels, balanced
    expected load); with ``noisy=False`` the ``w_gate_*`` start from small random values so top-k doesn't tie.
    Computed in float32 at least (float64 stays float64), with autocast off.
    """

    name, section = "hierarchical", "hierarchical"
    k_per_token = False
    routes_around_the_exchange = True    # the secondary gates run on the ranks of their groups' experts
    expert_stats_in_one_process = True   # a secondary gate picks among rows from every rank

    @classmethod
    def gating_counts(cls, config, d_model, num_experts):
        """The primary gate (W_g, W_noise [D, a]) for every token, the secondary ones ([D, b] each, a of them)
        for each of the token's k chosen groups."""
        a = config.hierarchical.num_groups
        b = num_experts // a
        return 2 * d_model * a + a * 2 * d_model * b, 2 * d_model * a + config.top_k * 2 * d_model * b

    @classmethod
    def dispatch_units(cls, config, num_experts):
        return config.hierarchical.num_groups   # rows go to groups; the secondary gate picks inside

    @classmethod
    def active_experts(cls, config):
        return config.top_k * config.hierarchical.top_k_secondary

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
        ep_size: int = 1,
        ep_rank: int = 0,
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
        _check_shard(a, ep_size, ep_rank)
        super().__init__(d_model, a * b, k_primary * k_secondary)   # k: experts per token
        self.num_groups, self.experts_per_group = a, b
        self.k_primary, self.k_secondary = k_primary, k_secondary
        self.w_importance, self.w_load = w_importance, w_load
        self.noisy, self.noise_epsilon = noisy, noise_epsilon
        self.num_local_groups, self.first_group = a // ep_size, ep_rank * (a // ep_size)
        # Names avoid the substring "expert": DeepSpeed's checkpointing treats such names as expert weights (the
        # layer presents the secondary matrices to it per expert itself).
        self.w_gate_primary = nn.Parameter(torch.zeros(d_model, a))
        self.w_noise_primary = nn.Parameter(torch.zeros(d_model, a))
        local = slice(self.first_group, self.first_group + self.num_local_groups)
        secondary = torch.zeros(a, d_model, b)
        if not noisy:   # drawn whole, so every expert-parallel size starts from the same gates
            self.small_init_(self.w_gate_primary, d_model)
            self.small_init_(secondary, d_model)
        self.w_gate_secondary = nn.Parameter(secondary[local].clone())
        self.w_noise_secondary = nn.Parameter(torch.zeros(self.num_local_groups, d_model, b))
        self.copies, self.counts_balance = None, True   # see `copied`

    @classmethod
    def from_config(cls, config: RouterConfig, d_model: int, num_experts: int, ep_size: int = 1,
                    ep_rank: int = 0) -> "HierarchicalRouter":
        """Only expert-parallel rank `ep_rank`'s share of the secondary matrices (they live beside the experts)."""
        h = config.hierarchical
        return cls(d_model, h.num_groups, num_experts // h.num_groups, k_primary=config.top_k,
                   k_secondary=h.top_k_secondary, w_importance=config.w_importance, w_load=config.w_load,
                   noisy=config.noisy_gating, ep_size=ep_size, ep_rank=ep_rank)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_groups={self.num_groups}, experts_per_group={self.experts_per_group}, "
            f"k_primary={self.k_primary}, k_secondary={self.k_secondary}, noisy={self.noisy}, "
            f"w_importance={self.w_importance}, w_load={self.w_load}, local_groups={self.first_group}.."
            f"{self.first_group + self.num_local_groups - 1}"
        )

    def sharded_parameters(self) -> dict[str, nn.Parameter]:
        """The secondary matrices [A/P, D, G]: split over the expert-parallel ranks with the groups' experts."""
        return {"w_gate_secondary": self.w_gate_secondary, "w_noise_secondary": self.w_noise_secondary}

    def shard(self, ep_size: int, ep_rank: int) -> None:
        """Keep only expert-parallel rank `ep_rank`'s groups' secondary matrices (a router built whole)."""
        _check_shard(self.num_groups, ep_size, ep_rank)
        local, first = self.num_groups // ep_size, ep_rank * (self.num_groups // ep_size)
        if (local, first) == (self.num_local_groups, self.first_group):
            return
        if self.num_local_groups != self.num_groups:
            last = self.first_group + self.num_local_groups - 1
            raise ValueError(f"this router already holds groups {self.first_group}..{last} only; build it whole "
                             f"(ep_size=1) to shard it again")
        with torch.no_grad():
            for param in self.sharded_parameters().values():
                param.data = param.data[first:first + local].clone()
        self.num_local_groups, self.first_group = local, first

    def copied(self, group, counts_balance: bool) -> None:
        """--etp-size T: the T ranks of `group` (each holding a shard of the same experts) hold copies of these
        groups' secondary matrices and score the same rows with them. Each copy's gradient is the share of its
        experts' shard, so the gradients sum over `group` in the backward; the balance statistics count only the
        copy with `counts_balance` (one per group of ranks), and noise drawn per rank is drawn on the tokens' ranks
        and sent with the rows (`noise_with_rows`), so every copy picks the same experts.

        The copies' graphs must stay alike: autograd runs the backward's collectives (this sum, the exchange's, the
        balance statistics') in graph order, and copies whose graphs differ could each wait in another one."""
        self.copies, self.counts_balance = group, counts_balance

    # ---------------------------------------------------------------- the three steps

    def route_groups(self, x_ND: Tensor) -> GroupRoute:
        """The primary gate: noisy top-Kp over the A groups for each token (on the token's rank)."""
        a, kp = self.num_groups, self.k_primary
        noisy = self.training and self.noisy
        with gating_precision(x_ND) as x_ND:
            clean_NA = self.logits(x_ND, self.w_gate_primary)
            raw_NA = self.logits(x_ND, self.w_noise_primary) if noisy else None
            noise_NA = self._sample_noise(x_ND.shape[0], a, x_ND.device).to(x_ND.dtype) if noisy else None
            gp_NKp, groups_NKp, load_A = _top_k(clean_NA, raw_NA, noise_NA, kp, self.noise_epsilon)
            groups_J = groups_NKp.reshape(-1)
            count_A = count_per_bin(groups_J, a, x_ND.dtype)
        return GroupRoute(gp_NKp.reshape(-1), groups_J, count_A if load_A is None else load_A, count_A)

    def noise_keys(self, num_tokens: int, device: torch.device) -> Optional[Tensor]:
        """The global noise row of each of this rank's J token-major rows, where the sampler draws by row (else
        None: the secondary noise is drawn where the rows are scored)."""
        sampler = self.noise_sampler
        if not (self.training and self.noisy and hasattr(sampler, "rows")):
            return None
        j = num_tokens * self.k_primary
        return sampler.first_row(j) + torch.arange(j, device=device)

    def noise_with_rows(self, num_tokens: int, device: torch.device) -> Optional[Tensor]:
        """What of the secondary noise travels with this rank's J token-major rows: their keys (`noise_keys`), or
        under copies (`copied`) with noise drawn per rank the noise itself [J, G], drawn here after the primary's,
        so that every copy scores a row with the same; None: drawn where the rows are scored."""
        keys_J = self.noise_keys(num_tokens, device)
        if keys_J is not None or self.copies is None or not (self.training and self.noisy):
            return keys_J
        return sample_noise(self.noise_sampler, num_tokens * self.k_primary, self.experts_per_group, device)

    def route_within_groups(self, x_RD: Tensor, row_M: Tensor, counts, group_M: Tensor, gates_M: Tensor,
                            noise_M: Optional[Tensor], num_tokens: int) -> WithinGroups:
        """The secondary gates of this rank's groups for M rows sorted by group: row m reads x_RD[row_M[m]],
        belongs to local group group_M[m] (`counts` rows per local group: device tensor, or (device, host)) and
        carries its primary gate gates_M[m] and what of its noise traveled with it (`noise_with_rows`: keys [M] or
        the noise [M, G]). `num_tokens`: tokens per rank (for keyed noise)."""
        b, ks, groups = self.experts_per_group, self.k_secondary, self.num_local_groups
        noisy = self.training and self.noisy
        with gating_precision(x_RD) as x_RD:
            dtype = x_RD.dtype
            layout = GroupLayout(counts, x_RD)
            pad = -b % (16 // x_RD.element_size()) if layout.kernel in ("grouped", "triton") else 0

            # under copies (`copied`) the matrices' gradients sum over the copies' ranks, in one all-reduce
            w_gate_aDG, *w_noise_aDG = copies_over(self.copies, self.w_gate_secondary,
                                                   *([self.w_noise_secondary] if noisy else []))

            def picked(w_aDG: Tensor) -> Tensor:
                w_aDG = w_aDG.to(dtype)
                if pad:   # grouped GEMMs read rows 16-byte aligned: zero columns up to the next multiple
                    w_aDG = nn.functional.pad(w_aDG, (0, pad))
                return _PickedGroupProduct.apply(x_RD, w_aDG, row_M, layout)[:, :b]

            clean_MG = picked(w_gate_aDG)
            raw_MG = noise_MG = None
            if noisy:
                raw_MG = picked(w_noise_aDG[0])
                noise_MG = self._secondary_noise(row_M.shape[0], noise_M, num_tokens, x_RD.device).to(dtype)
            # Load_i(X^(i)): the secondary smooth load summed per group, NOT multiplied by G_p
            gs_MKs, local_MKs, load_aG = _top_k(clean_MG, raw_MG, noise_MG, ks, self.noise_epsilon, group_M, groups)
            experts_MKs = group_M[:, None] * b + local_MKs
            if load_aG is None:
                load_aG = count_per_bin(experts_MKs, groups * b, dtype).reshape(groups, b)
            gates_MKs = gates_M.to(dtype)[:, None] * gs_MKs   # eq. 12: the primary gate applied once, here
            importance_aG = gates_MKs.new_zeros(groups * b).index_add(0, experts_MKs.reshape(-1), gates_MKs.reshape(-1))
        return WithinGroups(gates_MKs, experts_MKs, importance_aG.reshape(groups, b), load_aG)

    def _secondary_noise(self, m: int, noise_M: Optional[Tensor], num_tokens: int, device) -> Tensor:
        if noise_M is None:
            return sample_noise(self.noise_sampler, m, self.experts_per_group, device)
        if noise_M.dim() == 2:   # the noise itself
            return noise_M
        return self.noise_sampler.rows(num_tokens * self.k_primary, self.experts_per_group, noise_M, device)

    def balance(self, route: GroupRoute, within: WithinGroups) -> tuple[Tensor, Tensor, Tensor]:
        """(aux_loss, importance_E, load_E) from one sum over the data-parallel batch (eq. 13-14)."""
        a, b = self.num_groups, self.experts_per_group
        e, first, local = a * b, self.first_group * b, self.num_local_groups * b

        def spread(local_aG: Tensor) -> Tensor:   # this rank's groups' entries in an all-experts vector
            return nn.functional.pad(local_aG.reshape(-1), (first, e - first - local))

        secondary = [spread(within.importance_aG), spread(within.load_aG)]
        if not self.counts_balance:   # another copy of these groups' gates counts them (`copied`); times 0, not
            secondary = [t * 0.0 for t in secondary]   # zeros: the copies' graphs alike (see `copied`)
        stats = self.batch.sum(torch.cat([*secondary, route.load_A, route.count_A]))
        importance_E, load_s_E, load_p_A, count_A = stats.split([e, e, a, a])
        load_E = (load_p_A[:, None] * load_s_E.reshape(a, b) / (count_A[:, None] + _EPS)).reshape(-1)
        aux_loss = balance_loss(torch.stack([importance_E, load_E]), (self.w_importance, self.w_load))
        return aux_loss, importance_E, load_E

    def route(self, x_ND: Tensor) -> RouterOutput:
        """The whole gate on one rank (every group's secondary matrices here)."""
        if self.num_local_groups != self.num_groups:
            raise RuntimeError(f"this router holds the secondary gates of groups {self.first_group}.."
                               f"{self.first_group + self.num_local_groups - 1} only; HierarchicalMoELayer routes "
                               f"with it")
        n, kp, ks = x_ND.shape[0], self.k_primary, self.k_secondary
        route = self.route_groups(x_ND)
        order_J = torch.argsort(route.groups_J, stable=True)   # rows by group, what the grouped GEMM reads
        keys_J = self.noise_keys(n, x_ND.device)
        within = self.route_within_groups(x_ND, order_J // kp, count_per_bin(route.groups_J, self.num_groups),
                                          route.groups_J.index_select(0, order_J),
                                          route.gates_J.index_select(0, order_J),
                                          None if keys_J is None else keys_J.index_select(0, order_J), n)

        def token_major(sorted_JKs: Tensor) -> Tensor:
            return sorted_JKs.new_empty(sorted_JKs.shape).index_copy(0, order_J, sorted_JKs).reshape(n, kp * ks)

        aux_loss, importance_E, load_E = self.balance(route, within)
        return RouterOutput.from_top_k(token_major(within.gates_MKs), token_major(within.experts_MKs), aux_loss,
                                       importance_E, load_E)


def _check_shard(num_groups: int, ep_size: int, ep_rank: int) -> None:
    if ep_size < 1 or num_groups % ep_size:
        raise ValueError(f"hierarchical router: {num_groups} groups cannot be split over ep_size={ep_size} ranks "
                         f"(each rank holds whole groups: num_groups must be divisible by ep_size)")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"hierarchical router: ep_rank must be in [0, {ep_size}), got {ep_rank}")
