"""The MoE layer: router ─▶ dispatcher ─▶ experts ─▶ dispatcher, wired into DeepSpeed.

Legend (docs/shapes.md): N tokens, D model width, E experts over all ranks, K experts per token, C (token,
expert) pairs, R rows that arrive here, M pairs that arrive here.

How DeepSpeed sees the layer (expert parameters, their process groups, their checkpoint keys) lives in
moe/deepspeed_adapter.py; once the groups exist, `connect` hands them to the router (the data-parallel sum of
its balance statistics) and to the dispatcher (the expert-parallel exchange). The hierarchical gate routes in two
levels around the exchange: moe/hierarchical_layer.py. moe/build.py builds the layer a config asks for.
"""

from __future__ import annotations

import torch

from moe_scale.config import DispatchConfig, MoEConfig, choices
from moe_scale.distributed.comm import BatchCollectives
from moe_scale.distributed.launch import ranks_per_node
from moe_scale.moe.deepspeed_adapter import ParallelGroups
from moe_scale.moe.dispatch import build_dispatcher
from moe_scale.moe.experts import GroupedExperts
from moe_scale.moe.routed_layer import RoutedLayer
from moe_scale.moe.router import Router, build_router
from moe_scale.moe.shared_experts import SharedExperts

ALL_TO_ALL = choices(DispatchConfig, "all_to_all")


class MoELayer(RoutedLayer):
    """Sparsely-gated MoE of one-hidden-layer experts (Shazeer et al. 2017's ReLU ones by default; `kind` names
    another of moe/experts/kinds.py), built from its config: the router, dispatch and experts sections.

    The router is the one `config.router` asks for, unless one is given (any flat `Router`, moe/router/). With
    `config.experts.shared` S > 0, S always-active experts add their output to the routed one
    (moe/shared_experts.py).
    """

    routes_around_the_exchange = False   # HierarchicalMoELayer: the gate's second level runs beside the experts
    experts_read_slots = True   # capacity mode: fixed-size slots (moe/dispatch/static_capacity.py); False: counted

    def __init__(self, config: MoEConfig, d_model: int, ep_size: int = 1, ep_rank: int = 0, seed: int = 0,
                 kind: str = "relu", router: Router | None = None):
        """The layer at width `d_model` holding rank `ep_rank`'s experts of the `ep_size` ranks that hold one copy
        of every expert: with --etp-size T, ep_size / T expert-parallel ranks x T shards of each expert's hidden
        units (moe/deepspeed_adapter.py)."""
        experts, dispatch = config.experts, config.dispatch
        shards = experts.tensor_parallel
        if dispatch.all_to_all not in ALL_TO_ALL:
            raise ValueError(f"all_to_all must be one of {ALL_TO_ALL}, got {dispatch.all_to_all!r}")
        if router is None:
            router = build_router(config.router, d_model, experts.num_experts, ep_size // shards, ep_rank // shards)
        if router.routes_around_the_exchange != self.routes_around_the_exchange:
            raise ValueError("the hierarchical gate routes around the exchange: build HierarchicalMoELayer with it "
                             "(and MoELayer with a flat gate)")
        self.init_routed(experts.num_experts, ep_size, ep_rank, router, shards)
        self.k = config.router.top_k
        self.experts = GroupedExperts(self.num_local_experts, d_model, experts.hidden,
                                      first_global_expert=self.expert_rank * self.num_local_experts, seed=seed,
                                      recompute=experts.recompute, reuse_grad_buffers=experts.grad_reuse,
                                      activation=kind, shard=self.hidden_shard, shards=shards)
        self.dispatcher = build_dispatcher(*self.dispatch_units(), dispatch, slots=self.experts_read_slots)
        self.mark_expert_parameters()
        self.all_to_all, self.node_size = dispatch.all_to_all, dispatch.node_size
        # dense, on every rank (not in expert_shards); None: no shared experts, the state dict as before
        self.shared = SharedExperts(d_model, experts.shared_hidden or experts.hidden, experts.shared,
                                    experts.shared_gate, seed=seed, first_id=experts.num_experts,
                                    activation=kind) if experts.shared else None
        self.force_balanced = config.router.force_balanced_routing
        self.a2a_chunks = dispatch.a2a_chunks

    def dispatch_units(self) -> tuple[int, int]:
        """(what the dispatcher sends tokens to, how many of them live here): the experts, or with --etp-size T
        their T shards each (`shard_pairs`)."""
        return self.num_experts * self.tensor_parallel, self.num_local_experts

    def shard_pairs(self, token_C: torch.Tensor, expert_C: torch.Tensor, *values_C: torch.Tensor,
                    local: int | None = None) -> tuple[torch.Tensor, ...]:
        """--etp-size T: each (token, expert) pair becomes T pairs, one per shard of the expert, each sent to the
        rank holding that shard: unit (e // L) T L + s L + e % L lives on rank (e // L) T + s as local unit e % L
        (L: `local`, the units a rank holds; its experts by default). The shards' outputs, each of its hidden units'
        share, add up in the combine to the whole expert's; a token's pairs stay together (token-major), so the
        exchange can still go in pieces. `values_C` (the gates, ...) are copied to each of a pair's shards."""
        T, L = self.tensor_parallel, local or self.num_local_experts
        if T == 1:
            return token_C, expert_C, *values_C
        shards = torch.arange(T, device=expert_C.device)[None, :]
        units = (expert_C // L * (T * L) + expert_C % L)[:, None] + shards * L   # [pairs, shards]
        return self.per_shard(token_C), units.reshape(-1), *(self.per_shard(v) for v in values_C)

    def per_shard(self, values_C: torch.Tensor) -> torch.Tensor:
        """Each row of values_C [C, ...] repeated once per shard (--etp-size), in shard_pairs' order."""
        T = self.tensor_parallel
        if T == 1:
            return values_C
        return values_C[:, None].expand(-1, T, *values_C.shape[1:]).reshape(-1, *values_C.shape[1:])

    def connect(self, parallel: ParallelGroups) -> None:
        """The one place the layer's parts meet the process groups."""
        self.router.connect(BatchCollectives(parallel.data_parallel))
        self.experts.split_rows_over(parallel.expert_tensor_parallel)
        hierarchical = self.all_to_all == "hierarchical" and self.ep_size > 1
        self.dispatcher.connect(parallel.expert_parallel, self.all_to_all,
                                ranks_per_node(self.node_size) if hierarchical else 0)

    @property
    def data_parallel_group(self):
        return None if self.groups is None else self.groups.data_parallel

    def forward(self, x_ND: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_ND, aux_loss). `seq_len`: the rows are sequences of that many consecutive tokens (a gate
        with a per-sequence loss reads it; None: one sequence)."""
        self.require_groups()
        route = self.route(x_ND, seq_len)
        token_C, expert_C, gate_C = self.shard_pairs(*self.real_pairs(route.pairs(), x_ND.shape[0]))
        if self.a2a_chunks > 1 and self.dispatcher.exchanges and route.top_k is not None \
                and expert_C.shape[0] == x_ND.shape[0] * route.top_k * self.tensor_parallel:   # token-major
            return self.overlapped(x_ND, token_C, expert_C, gate_C), route.aux_loss
        # (every_token matters in dropless mode only, where real_pairs leaves the pairs whole)
        rows_RD, state = self.dispatcher.dispatch_rows(x_ND, token_C, expert_C, gate_C,
                                                       every_token=route.top_k is not None)
        self.keep_dropped_fraction(state)
        # The experts gather each arrived pair's row and return the gate-weighted sum per row.
        per_row_RD = self.experts(rows_RD, state.expert_counts(), state.pair_rows(),
                                  self.dispatcher.follow_pairs(gate_C, state))
        return self.plus_shared(x_ND, self.dispatcher.combine_rows(per_row_RD, state).to(x_ND.dtype)), \
            route.aux_loss

    def overlapped(self, x_ND: torch.Tensor, token_C: torch.Tensor, expert_C: torch.Tensor,
                   gate_C: torch.Tensor) -> torch.Tensor:
        """forward's exchange and experts in `a2a_chunks` pieces (moe/dispatch/pieces.py): the experts compute one
        piece while the next arrives and the last goes back; the shared experts compute while the first is in
        flight. The same output as one piece."""
        pieces = self.dispatcher.dispatch_pieces(x_ND, token_C, expert_C, gate_C, self.a2a_chunks)
        shared_ND = None if self.shared is None else self.shared(x_ND)
        for piece in pieces:
            rows_RD, counts, row_of_pair_M, gate_M = piece.land()
            piece.start_back(self.experts(rows_RD, counts, row_of_pair_M, gate_M))
        self.keep_dropped_fraction(pieces)
        routed_ND = pieces.combine().to(x_ND.dtype)
        return routed_ND if shared_ND is None else routed_ND + shared_ND.to(routed_ND.dtype)

    def real_pairs(self, pairs_C: tuple[torch.Tensor, ...], num_tokens: int) -> tuple[torch.Tensor, ...]:
        """Capacity mode (or a rank budget): the pairs of real tokens only, where real_tokens() marks padding
        (evaluation's last windows), so padding neither takes an expert's capacity nor enlarges it: the real tokens
        keep what an unpadded batch of them keeps. One host read (a mask's size), at evaluation only; otherwise the
        pairs."""
        real_N = self.real_rows(num_tokens)
        if not self.dispatcher.drops or real_N is None:
            return pairs_C
        keep_C = real_N.index_select(0, pairs_C[0]).nonzero()[:, 0]
        return tuple(t.index_select(0, keep_C) for t in pairs_C)

    def plus_shared(self, x_ND: torch.Tensor, routed_ND: torch.Tensor) -> torch.Tensor:
        """The routed output plus the shared experts' (moe/shared_experts.py), if the layer has them."""
        return routed_ND if self.shared is None else routed_ND + self.shared(x_ND).to(routed_ND.dtype)

    def keep_dropped_fraction(self, state) -> None:
        if self.dispatcher.drops:
            self.stats.metrics["dropped_fraction"] = self.dispatcher.dropped_fraction(state, self.data_parallel_group)
