"""The MoE layer: router ─▶ dispatcher ─▶ experts ─▶ dispatcher, wired into DeepSpeed.

Legend: N tokens, D model dim, E global experts, K experts per token.

How DeepSpeed sees the layer (expert parameters, their process groups, their checkpoint keys) lives in
moe/deepspeed_adapter.py; once the groups exist, `connect` hands them to the router (the data-parallel sum of
its balance statistics) and to the dispatcher (the expert-parallel exchange).

With the hierarchical gate the layer routes in two levels, as the paper places it (App. B): the primary gate
picks Kp groups per token on the token's rank, the dispatcher sends one row per (token, picked group) to the
rank that holds the group, and there the group's secondary gate (sharded with its experts) picks Ks experts,
whose gated outputs go back summed per row. A dispatcher's "experts" are then groups: capacity mode bounds the
(token, group) rows a group takes from each rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe_scale.distributed.comm import collective_device
from moe_scale.distributed.launch import ranks_per_node
from moe_scale.moe.deepspeed_adapter import ExpertParallelModule, ExpertShard, ParallelGroups
from moe_scale.moe.dispatch import AllToAllDispatcher
from moe_scale.moe.experts import GroupedExperts
from moe_scale.moe.experts.grouped_gemm import BlockCounts
from moe_scale.moe.kernel_policy import count_per_bin
from moe_scale.config import MoEConfig
from moe_scale.moe.router import HierarchicalRouter, NoisyTopKRouter, Router, build_router

ALL_TO_ALL = ("flat", "hierarchical")


@dataclass
class MoEStats:
    """Balance statistics of the last forward, over the whole data-parallel batch (detached)."""

    importance_E: torch.Tensor
    load_E: torch.Tensor
    metrics: dict[str, float | torch.Tensor]   # the router's own numbers (e.g. threshold agreement)
    routed_E: torch.Tensor | None = None      # hard counts per expert: this rank's tokens (hierarchical gate: the
                                              # pairs this rank's experts received); summed over ranks: the batch's


class MoELayer(ExpertParallelModule):
    """Sparsely-gated MoE of one-hidden-layer ReLU experts (Shazeer et al. 2017).

    The router defaults to noisy top-k with k experts per token; pass any other `Router` (moe/router/).
    """

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, k: int, ep_size: int = 1,
                 ep_rank: int = 0, w_importance: float = 0.1, w_load: float = 0.1, noisy_gating: bool = True,
                 seed: int = 0, router: Router | None = None, recompute: bool = False,
                 dispatch_mode: str = "dropless", capacity_factor: float = 1.0, all_to_all: str = "flat",
                 node_size: int = 0, reuse_grad_buffers: bool = True):
        self.init_expert_parallel(num_experts, ep_size, ep_rank)
        if all_to_all not in ALL_TO_ALL:
            raise ValueError(f"all_to_all must be one of {ALL_TO_ALL}, got {all_to_all!r}")
        self.k = k
        self.router = router if router is not None else NoisyTopKRouter(
            d_model, num_experts, k, w_importance=w_importance, w_load=w_load, noisy=noisy_gating)
        self.experts = GroupedExperts(self.num_local_experts, d_model, d_hidden,
                                      first_global_expert=ep_rank * self.num_local_experts, seed=seed,
                                      recompute=recompute, reuse_grad_buffers=reuse_grad_buffers)
        self.two_level = isinstance(self.router, HierarchicalRouter)
        if self.two_level:   # each rank keeps the secondary gates of its experts' groups
            self.router.shard(ep_size, ep_rank)
            self.dispatcher = AllToAllDispatcher(self.router.num_groups, self.router.num_local_groups,
                                                 dispatch_mode, capacity_factor)
        else:
            self.dispatcher = AllToAllDispatcher(num_experts, self.num_local_experts, dispatch_mode, capacity_factor)
        self.mark_expert_parameters()
        self.all_to_all, self.node_size = all_to_all, node_size
        self.stats: MoEStats | None = None

    @classmethod
    def from_config(cls, config: MoEConfig, d_model: int, ep_size: int = 1, ep_rank: int = 0,
                    seed: int = 0) -> "MoELayer":
        """The layer of `config` (router, dispatch and experts settings) at width `d_model`."""
        experts, dispatch = config.experts, config.dispatch
        return cls(d_model, experts.hidden, experts.num_experts, config.router.top_k, ep_size=ep_size,
                   ep_rank=ep_rank, seed=seed,
                   router=build_router(config.router, d_model, experts.num_experts, ep_size, ep_rank),
                   recompute=experts.recompute, dispatch_mode=dispatch.mode,
                   capacity_factor=dispatch.capacity_factor, all_to_all=dispatch.all_to_all,
                   node_size=dispatch.node_size, reuse_grad_buffers=experts.grad_reuse)

    def expert_shards(self) -> dict[str, ExpertShard]:
        shards = super().expert_shards()
        if self.two_level:
            for name, param in self.router.sharded_parameters().items():
                shards[f"router.{name}"] = ExpertShard(param, self.router.num_local_groups, self.router.num_groups,
                                                       self.router.experts_per_group)
        return shards

    def connect(self, parallel: ParallelGroups) -> None:
        """The one place the layer's parts meet the process groups."""
        self.router.connect(parallel.data_parallel)
        hierarchical = self.all_to_all == "hierarchical" and self.ep_size > 1
        self.dispatcher.connect(parallel.expert_parallel, self.all_to_all,
                                ranks_per_node(self.node_size) if hierarchical else 0)

    @property
    def data_parallel_group(self):
        return None if self.groups is None else self.groups.data_parallel

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_ND, aux_loss)."""
        self.require_groups()
        if self.two_level:
            return self._forward_two_level(x_ND)
        route = self.router(x_ND)
        token_index_C, expert_C, gate_C = route.pairs()
        if self.record_routes:
            self.routes = (token_index_C, expert_C, gate_C)
        self.stats = MoEStats(route.importance_E.detach(), route.load_E.detach(), dict(route.metrics),
                              count_per_bin(expert_C, self.num_experts))
        rows_RD, state = self.dispatcher.dispatch_rows(x_ND, token_index_C, expert_C, gate_C)
        if self.dispatcher.mode == "capacity":
            self.stats.metrics["dropped_fraction"] = self._dropped_fraction(state)
        # The experts gather each arrived pair's row and return the gate-weighted sum per row.
        per_row_RD = self.experts(rows_RD, (state.tokens_per_expert_L, state.tokens_per_expert),
                                  state.arrived_row_M, self.dispatcher.pair_gates(gate_C, state))
        return self.dispatcher.combine_rows(per_row_RD, state).to(x_ND.dtype), route.aux_loss

    def _forward_two_level(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The hierarchical gate's placement: groups picked here, experts picked beside them (M arrived (token,
        group) rows, Q = M*Ks (row, expert) pairs)."""
        router, dispatcher = self.router, self.dispatcher
        n, kp, ks = x_ND.shape[0], router.k_primary, router.k_secondary
        route = router.route_groups(x_ND)
        token_J = torch.arange(n, device=x_ND.device).repeat_interleave(kp, output_size=n * kp)
        rows_RD, state = dispatcher.dispatch_rows(x_ND, token_J, route.groups_J, route.gates_J)
        keys_J = router.noise_keys(n, x_ND.device)
        arrived = state.arrived_row_M.shape[0]
        group_M = torch.repeat_interleave(torch.arange(router.num_local_groups, device=x_ND.device),
                                          state.tokens_per_expert_L, output_size=arrived)
        within = router.route_within_groups(
            rows_RD, state.arrived_row_M, (state.tokens_per_expert_L, state.tokens_per_expert), group_M,
            dispatcher.pair_gates(route.gates_J, state),
            None if keys_J is None else dispatcher.follow_pairs(keys_J, state), n)
        aux_loss, importance_E, load_E = router.balance(route, within)
        # The experts read the (row, expert) pairs sorted by local expert.
        expert_Q = within.experts_MKs.reshape(-1)
        by_expert_Q = torch.argsort(expert_Q, stable=True)
        row_Q = state.arrived_row_M.repeat_interleave(ks, output_size=arrived * ks).index_select(0, by_expert_Q)
        gate_Q = within.gates_MKs.reshape(-1).index_select(0, by_expert_Q)
        counts_L = count_per_bin(expert_Q, self.num_local_experts)
        first = self.ep_rank * self.num_local_experts
        self.stats = MoEStats(importance_E.detach(), load_E.detach(), {},
                              nn.functional.pad(counts_L, (first, self.num_experts - first - self.num_local_experts)))
        if dispatcher.mode == "capacity":
            self.stats.metrics["dropped_fraction"] = self._dropped_fraction(state)
        if self.record_routes:   # one process: arrived rows are this rank's tokens
            token_R = torch.arange(n, device=x_ND.device) if state.rows_are_tokens else state.unique_token_U
            self.routes = (token_R.index_select(0, row_Q), expert_Q.index_select(0, by_expert_Q) + first, gate_Q)
        # Per group the host knows its rows' Ks pairs from the exchange's one read: enough to split the experts'
        # grouped GEMMs at group edges without reading counts_L.
        host = BlockCounts(router.experts_per_group, [rows * ks for rows in state.tokens_per_expert])
        per_row_RD = self.experts(rows_RD, (counts_L, host), row_Q, gate_Q)
        return dispatcher.combine_rows(per_row_RD, state).to(x_ND.dtype), aux_loss

    def _dropped_fraction(self, state) -> torch.Tensor:
        """Dropped copies / routed copies over the whole data-parallel batch (a device scalar, read with the
        other metrics at log intervals)."""
        counts = torch.empty(2, dtype=torch.float64, device=collective_device())
        counts[0], counts[1] = state.dropped_pairs, state.num_pairs   # fills: no host-to-device copy
        group = self.data_parallel_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        return counts[0] / counts[1].clamp(min=1)
