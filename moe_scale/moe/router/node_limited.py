"""Node-limited (group-limited) top-k: DeepSeek-V3's gate (Liu et al. 2024, §2.1.2 and §3.2.2; Megatron-Core's
`moe_router_num_groups` / `moe_router_group_topk`, torchtitan's `num_expert_groups` / `num_limited_groups`).

Legend (docs/shapes.md): N tokens, D model width, E experts, K experts per token, A expert groups, G experts per
group (E = A·G).

The experts are cut into A groups of G consecutive experts (one per expert-parallel rank by default, or one per
node: the experts of a rank are consecutive). A token first picks its M best groups, a group's score being the sum
of its 2 best (biased) expert scores; then its K experts among those M·G, so its rows go to at most M ranks or
nodes, which bounds the expensive inter-node part of the all-to-all. Scores, routing biases and the
sequence-wise loss are the auxiliary-loss-free gate's (aux_free.py: sigmoid or softmax scores, top-k of score +
bias, the bias following the load); the gates are the chosen scores, divided by their sum (`normalize`,
DeepSeek-V3's norm_topk_prob) and multiplied by `routed_scaling_factor` (2.5 in DeepSeek-V3). `w_importance` adds
the CV² importance loss (Shazeer et al. eq. 6) on top, 0 unless given. With M = A every group is open and the
gate equals aux_free's top-k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_scale.config import RouterConfig
from moe_scale.moe.losses import cv_squared
from moe_scale.moe.router.aux_free import AuxFreeRouter

GROUP_SCORE_TOP = 2   # a group's score: the sum of its best 2 scores (DeepSeek-V3)


def group_limited_top_k(biased_NE: Tensor, k: int, groups: int, group_top_k: int) -> Tensor:
    """Each token's k best experts within its `group_top_k` best of `groups` groups of consecutive experts
    (descending by score); whole-tensor, no host read."""
    n, e = biased_NE.shape
    if group_top_k >= groups:
        return biased_NE.topk(k, dim=1).indices
    per_group = e // groups
    by_group_NAG = biased_NE.view(n, groups, per_group)
    group_score_NA = by_group_NAG.topk(min(GROUP_SCORE_TOP, per_group), dim=2).values.sum(2)
    best = group_score_NA.topk(group_top_k, dim=1).indices   # [N, group_top_k]
    open_NA = torch.zeros(n, groups, dtype=torch.bool, device=biased_NE.device).scatter_(1, best, True)
    closed_NE = ~open_NA.repeat_interleave(per_group, dim=1, output_size=e)
    return biased_NE.masked_fill(closed_NE, float("-inf")).topk(k, dim=1).indices


class NodeLimitedRouter(AuxFreeRouter):
    """The aux_free gate whose top-k is limited to each token's best groups (module docstring)."""

    name, section = "node_limited", "node_limited"

    def __init__(self, d_model: int, num_experts: int, k: int, groups: int, group_top_k: int,
                 score: str = "sigmoid", bias_update_rate: float = 0.001, seq_balance_weight: float = 0.0,
                 normalize: bool = True, routed_scaling_factor: float = 1.0, w_importance: float = 0.0):
        super().__init__(d_model, num_experts, k, score=score, bias_update_rate=bias_update_rate,
                         seq_balance_weight=seq_balance_weight)
        if groups < 1 or num_experts % groups or not 1 <= group_top_k or k > min(group_top_k, groups) * (
                num_experts // groups):
            raise ValueError(f"{num_experts} experts in {groups} groups, {group_top_k} open: cannot choose {k}")
        self.groups, self.group_top_k = groups, group_top_k
        self.normalize, self.routed_scaling_factor, self.w_importance = normalize, routed_scaling_factor, w_importance

    @classmethod
    def from_config(cls, config: RouterConfig, d_model: int, num_experts: int, ep_size: int = 1,
                    ep_rank: int = 0) -> "NodeLimitedRouter":
        a, g = config.aux_free, config.node_limited
        return cls(d_model, num_experts, config.top_k, groups=g.expert_groups or ep_size, group_top_k=g.group_top_k,
                   score=a.score, bias_update_rate=a.bias_update_rate, seq_balance_weight=a.seq_balance_weight,
                   normalize=g.normalize, routed_scaling_factor=g.routed_scaling_factor,
                   w_importance=config.w_importance)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, groups={self.groups}, group_top_k={self.group_top_k}, "
                f"normalize={self.normalize}, routed_scaling_factor={self.routed_scaling_factor}, "
                f"w_importance={self.w_importance}")

    def choose(self, biased_NE: Tensor) -> Tensor:
        return group_limited_top_k(biased_NE, self.k, self.groups, self.group_top_k)

    def gates(self, chosen_NK: Tensor) -> Tensor:
        if self.normalize:
            chosen_NK = chosen_NK / chosen_NK.sum(1, keepdim=True).clamp_min(torch.finfo(chosen_NK.dtype).tiny)
        return chosen_NK * self.routed_scaling_factor if self.routed_scaling_factor != 1.0 else chosen_NK

    def balance_loss(self, importance_E: Tensor) -> Tensor | None:
        return self.w_importance * cv_squared(importance_E) if self.w_importance else None
