"""The MoE layer of the hierarchical gate: the gate's two levels placed as the paper places them (App. B).

Legend (docs/shapes.md): N tokens, D model width, E experts over all ranks, L local experts, Kp primary k
(groups per token), Ks secondary k (experts per chosen group), J = N*Kp (token, chosen group) rows sent,
R rows that arrive here, M (token, group) pairs that arrive here (the dispatcher's pairs: its experts are groups).

The primary gate picks Kp groups per token on the token's rank; the dispatcher sends one row per (token, picked
group) to the rank that holds the group; there the group's secondary gate (sharded with its experts) picks Ks
experts, whose gated outputs go back summed per row. The dispatcher's "experts" are groups here: capacity mode
bounds the (token, group) rows a group takes from each rank.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_scale.moe.deepspeed_adapter import ExpertShard, ParallelGroups, mark_copies
from moe_scale.moe.expert_counts import BlockCounts, ExpertCounts
from moe_scale.moe.kernel_policy import count_per_bin
from moe_scale.moe.layer import MoELayer
from moe_scale.moe.routed_layer import routed_balance
from moe_scale.config import MoEConfig
from moe_scale.moe.router import HierarchicalRouter, build_router


class HierarchicalMoELayer(MoELayer):
    """MoELayer whose router is a `HierarchicalRouter`: each rank keeps the secondary gates of its experts'
    groups, and tokens travel once per chosen group."""

    routes_around_the_exchange = True
    experts_read_slots = False   # the secondary gate routes each arrived (token, group) row: counted messages

    def __init__(self, config: MoEConfig, d_model: int, ep_size: int = 1, ep_rank: int = 0, seed: int = 0,
                 kind: str = "relu", router: HierarchicalRouter | None = None):
        """As MoELayer's; the router keeps only this rank's groups' secondary gates (a router built whole is
        sharded here). With --etp-size T the T ranks holding shards of the same experts each hold a copy of their
        groups' secondary gates (`HierarchicalRouter.copied`): DeepSpeed's norms count only the first."""
        shards = config.experts.tensor_parallel
        if router is None:
            router = build_router(config.router, d_model, config.experts.num_experts, ep_size // shards,
                                  ep_rank // shards)
        if isinstance(router, HierarchicalRouter):   # MoELayer refuses any other router, in one line
            router.shard(ep_size // shards, ep_rank // shards)
        super().__init__(config, d_model, ep_size, ep_rank, seed, kind, router=router)
        if self.hidden_shard:
            mark_copies(self.shard_copies())

    def dispatch_units(self) -> tuple[int, int]:
        """The groups (their shards, with --etp-size): tokens travel once per chosen group, to the rank that holds
        it (to each of the ranks holding its shards)."""
        return self.router.num_groups * self.tensor_parallel, self.router.num_local_groups

    def shard_copies(self) -> list[nn.Parameter]:
        return list(self.router.sharded_parameters().values())

    def connect(self, parallel: ParallelGroups) -> None:
        super().connect(parallel)
        self.router.copied(parallel.expert_tensor_parallel, counts_balance=self.hidden_shard == 0)

    def expert_shards(self) -> dict[str, ExpertShard]:
        shards = super().expert_shards()
        router = self.router
        for name, param in router.sharded_parameters().items():
            shards[f"router.{name}"] = ExpertShard(param, router.num_local_groups, router.num_groups,
                                                   router.experts_per_group)
        return shards

    def forward(self, x_ND: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_ND, aux_loss): groups picked here, experts picked beside them (`seq_len`: unused, the
        hierarchical gate has no per-sequence loss)."""
        self.require_groups()
        router, dispatcher = self.router, self.dispatcher
        n, kp, ks = x_ND.shape[0], router.k_primary, router.k_secondary
        groups = router.route_groups(x_ND)
        token_J = torch.arange(n, device=x_ND.device).repeat_interleave(kp, output_size=n * kp)
        noise_J = router.noise_with_rows(n, x_ND.device)
        # capacity mode: padding's (token, group) rows are left out (MoELayer.real_pairs); --etp-size: a row per
        # shard of the group
        token_J, group_J, gate_J, *noise = self.shard_pairs(*self.real_pairs(
            (token_J, groups.groups_J, groups.gates_J, *([] if noise_J is None else [noise_J])), n),
            local=router.num_local_groups)
        padding_sent = token_J.shape[0] == n * kp * self.tensor_parallel
        rows_RD, state = dispatcher.dispatch_rows(x_ND, token_J, group_J, gate_J, every_token=True)
        row_M = state.pair_rows()
        within = router.route_within_groups(
            rows_RD, row_M, state.expert_counts(), state.pair_local_experts(),
            dispatcher.follow_pairs(gate_J, state), dispatcher.follow_pairs(noise[0], state) if noise else None, n)
        aux_loss, importance_E, load_E = router.balance(groups, within)

        # The experts read the (row, expert) pairs sorted by local expert.
        arrived = row_M.shape[0]
        expert_MKs = within.experts_MKs.reshape(-1)
        by_expert = torch.argsort(expert_MKs, stable=True)
        row_of_pair = row_M.repeat_interleave(ks, output_size=arrived * ks).index_select(0, by_expert)
        gate_of_pair = within.gates_MKs.reshape(-1).index_select(0, by_expert)
        counts_L = count_per_bin(expert_MKs, self.num_local_experts)
        first = self.expert_rank * self.num_local_experts
        self.keep_stats(importance_E, load_E, {}, *(
            nn.functional.pad(local_L, (first, self.num_experts - first - self.num_local_experts))
            if self.hidden_shard == 0 else local_L.new_zeros(self.num_experts)   # (counted by shard 0's rank)
            for local_L in self._routed_balance(within, state, n, padding_sent)))
        self.keep_dropped_fraction(state)
        self.keep_routes(lambda: (state.local_row_tokens().index_select(0, row_of_pair),   # one process: arrived
                                  expert_MKs.index_select(0, by_expert) + first, gate_of_pair))  # rows are its own
        # Per group the host knows its rows' Ks pairs from the exchange's one read (where there was one): enough to
        # split the experts' grouped GEMMs at group edges without reading counts_L.
        group_rows = state.expert_counts().host
        counts = ExpertCounts(counts_L, blocks=None if group_rows is None else
                              BlockCounts(router.experts_per_group, [rows * ks for rows in group_rows]))
        per_row_RD = self.experts(rows_RD, counts, row_of_pair, gate_of_pair)
        return self.plus_shared(x_ND, dispatcher.combine_rows(per_row_RD, state).to(x_ND.dtype)), aux_loss

    def _routed_balance(self, within, state, num_tokens: int, padding_sent: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(pairs, summed gates) per local expert of the pairs that arrived here from real tokens: the mask
        travels with the (token, group) rows (one more exchange, only while real_tokens() marks padding and its
        rows were sent)."""
        real_N = self.real_rows(num_tokens)
        weight_MKs = None
        if real_N is not None and padding_sent:
            kp = self.router.k_primary
            real_J = self.per_shard(real_N.float().repeat_interleave(kp, output_size=num_tokens * kp))
            weight_MKs = self.dispatcher.follow_pairs(real_J, state)[:, None].expand_as(within.gates_MKs).reshape(-1)
        return routed_balance(within.experts_MKs.reshape(-1), within.gates_MKs.reshape(-1), weight_MKs,
                              self.num_local_experts)
