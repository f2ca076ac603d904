"""Token dispatcher: send each token to the ranks that own its experts, and bring the results back.

Legend (docs/shapes.md): N tokens on this rank, C (token, expert) pairs routed from this rank (N*K for a
top-k gate), S pairs kept (C when dropless), U distinct (token, destination rank) rows sent, D model width,
E experts over all ranks, P expert-parallel ranks, L = E / P local experts per rank, M pairs that arrive here,
R rows that arrive here, X count columns exchanged side by side.

Expert e lives on EP rank e // L. Memory grows with N*K and N*P (a mark per (rank, token) numbers the rows),
never with N*E: no dense dispatch mask, no [tokens, experts, capacity] tensor.

    dispatch:  sort the copies by expert (capacity mode: by expert, then by gate, highest first, and move
               each expert's copies beyond its capacity to the end) ─▶ one row per (token, destination rank),
               however many of its experts live there, plus one int per pair saying which of those rows it
               uses ─▶ the exchange (moe/dispatch/exchange.py: counts of pairs and rows in one exchange and one read to
               the host, then variable-size all-to-alls, flat or hierarchical) ─▶ the receiver expands rows to
               pairs, grouped by local expert
    combine:   the gates follow the pairs; the receiver sums gate x expert output per arrived row, so the
               way back carries one row per (token, rank) too, and the sender adds each token's rows

Everything before the exchange works on all C pairs with static shapes (dropped copies sort last, distinct
rows are marked rather than compacted), so the only device-to-host copy of the step is the exchange's read
of the counts, which all_to_all_single needs as Python ints; what is compacted afterwards is cut at those
counts (the rows by nonzero_static, whose size is then known: no read on a GPU). No unique, nonzero, bincount or
item on the way. The planning is a few whole-tensor operations whatever E (tests/moe/dispatch: the launches of a
2-rank dispatch are pinned); the arrived pairs' rows take the source ranks' row offsets from the host's counts.
With one rank, dropless, and every token routed (the caller says so: `every_token`), the sizes are known without
the counts (C pairs, N rows), and nothing is read.

The MoE layer uses the row-level halves: `dispatch_rows` stops at the arrived rows and `combine_rows` starts
from the per-row sums, because its experts gather the pairs' rows and sum their gated outputs themselves
(moe/experts/ffn.py), which saves neither a per-pair copy of the inputs nor of the outputs. With one rank and
every token routed, the rows are the tokens themselves: nothing is copied at all.

A token with several experts on one rank crosses the network once: with the hierarchical gate (a group's
experts share a rank) each token travels once per chosen group, not once per expert.

A per-rank receive budget (`rank_capacity_factor` F > 0, dropless mode; Megatron-Core's
`moe_expert_rank_capacity_factor`) drops only a skew's overflow: each rank sends each expert-parallel rank at most
ceil(F * C / P) copies, its highest gates (ties: the lower pair index), so no rank receives more than the sum of
those, about F x the balanced load, and the dropped copies are counted as capacity mode's are.

Capacity mode follows GShard / Switch: an expert takes at most ceil(capacity_factor * C / E) copies *from
each rank* (capacity is per sending rank, so it bounds every message), keeping the copies with the highest
gates (ties: the lower pair index). A dropped copy contributes nothing to its token's output; a token whose
copies are all dropped outputs zero (the model's residual carries it). The same rank's tokens drop the same
copies whatever the expert-parallel size.

A dispatcher never knows how gates were chosen; it only sees expert ids and gate values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_scale.config import DispatchConfig, choices
from moe_scale.distributed.comm import collective_device, world_size
from moe_scale.moe.dispatch.exchange import (CommTimer, FlatExchange, HierarchicalExchange, InFlight, LocalExchange,
                                             Route, build_hierarchical_groups)
from moe_scale.moe.dispatch.pieces import chunk_bounds
from moe_scale.moe.expert_counts import ExpertCounts
from moe_scale.moe.kernel_policy import count_per_bin

MODES = choices(DispatchConfig, "mode")
# Up to this many ranks the arrived pairs' row offsets are added per source rank, from host ints (P - 1 launches);
# beyond, in five launches whatever P (the 4-rank tests take that path).
_HOST_OFFSET_RANKS = 3


@dataclass
class DispatchState:
    """What `combine` needs to undo `dispatch`."""

    sort_order_S: torch.Tensor          # kept pairs, expert-sorted -> pair index
    unique_token_U: torch.Tensor | None   # token of each sent row (None where the rows are the tokens)
    row_route: Route                    # how the U rows travelled
    pair_route: Route                   # how the S pairs travelled
    arrived_row_M: torch.Tensor         # for each arrived pair, its row among the R arrived rows
    num_arrived_rows: int               # R
    tokens_per_expert: list[int] | None   # pairs per local expert after the exchange (host; None: not read)
    tokens_per_expert_L: torch.Tensor   # the same on the device
    num_tokens: int
    dropped_pairs: int                  # copies this rank dropped (capacity mode)
    num_pairs: int                      # copies this rank routed
    rows_are_tokens: bool               # one rank, every token routed: row u is token u, nothing moved

    def expert_counts(self) -> ExpertCounts:
        """Arrived pairs per local expert: on the device [L], and on the host where the exchange read them."""
        return ExpertCounts(self.tokens_per_expert_L, self.tokens_per_expert)

    def pair_rows(self) -> torch.Tensor:
        """[M]: the arrived row each arrived pair reads (pairs grouped by local expert)."""
        return self.arrived_row_M

    def pair_local_experts(self) -> torch.Tensor:
        """[M]: the local expert of each arrived pair."""
        counts_L = self.tokens_per_expert_L
        return torch.repeat_interleave(torch.arange(counts_L.shape[0], device=counts_L.device), counts_L,
                                       output_size=self.arrived_row_M.shape[0])

    def local_row_tokens(self) -> torch.Tensor:
        """[R]: the token of each arrived row, when every row came from this rank (one process)."""
        if self.rows_are_tokens:
            return torch.arange(self.num_tokens, device=self.arrived_row_M.device)
        return self.unique_token_U


@dataclass
class _Marks:
    """A dispatch planned up to the exchange (AllToAllDispatcher._mark): all on the device."""

    order_C: torch.Tensor            # copies sorted: kept ones by expert, then the dropped ones
    counts_PL: torch.Tensor          # kept copies per (destination rank, local expert)
    rows_per_rank_P1: torch.Tensor   # rows per destination rank
    marked_PN: torch.Tensor          # the (rank, token) keys a kept copy has
    row_in_message_C: torch.Tensor   # each sorted copy's row within its destination's message
    num_tokens: int
    num_pairs: int

    def counts(self) -> list[torch.Tensor]:
        """What the exchange plans from: pairs, then rows."""
        return [self.counts_PL, self.rows_per_rank_P1]

    def rows(self, row_route: Route) -> torch.Tensor:
        """[U]: the token of each sent row. The marked keys in order are the rows; their number is now known, so no
        read sizes the compaction."""
        num_rows = row_route.num_sent
        return torch.nonzero_static(self.marked_PN, size=num_rows)[:, 0] % max(self.num_tokens, 1)

    def row_in_message(self, pair_route: Route) -> torch.Tensor:
        """[S, 1]: the kept copies' rows within their messages, as the pairs' metadata travels."""
        return self.row_in_message_C[:pair_route.num_sent, None]


class AllToAllDispatcher:
    """All-to-all dispatch over an expert-parallel group; `exchange` is set by the layer once groups exist."""

    def __init__(self, num_experts: int, num_local_experts: int, mode: str = "dropless",
                 capacity_factor: float = 1.0, rank_capacity_factor: float = 0.0):
        if mode not in MODES:
            raise ValueError(f"dispatch mode must be one of {MODES}, got {mode!r}")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
        if rank_capacity_factor and (mode != "dropless" or rank_capacity_factor < 1):
            raise ValueError(f"rank_capacity_factor is for dropless dispatch, at least 1: got {rank_capacity_factor}")
        self.num_experts, self.num_local_experts = num_experts, num_local_experts
        self.ep_size = num_experts // num_local_experts
        self.mode, self.capacity_factor, self.rank_capacity_factor = mode, capacity_factor, rank_capacity_factor
        self.exchange = LocalExchange()

    @property
    def drops(self) -> bool:
        """Whether copies may be dropped: capacity mode, or a per-rank receive budget."""
        return self.mode == "capacity" or bool(self.rank_capacity_factor)

    @property
    def ep_group(self):
        """The expert-parallel group rows travel over (None until connected)."""
        return self.exchange.group

    @property
    def timer(self) -> CommTimer:
        """Seconds spent in this dispatcher's all-to-alls (forward and backward)."""
        return self.exchange.timer

    def connect(self, group, all_to_all: str = "flat", ranks_per_node: int = 0) -> None:
        """Move rows over `group`: with one flat all-to-all, or (`all_to_all="hierarchical"`) within each node of
        `ranks_per_node` ranks first and then across nodes. Collective over the whole world when hierarchical."""
        timer = self.exchange.timer
        if world_size(group) == 1:
            self.exchange = LocalExchange(timer, group)
        elif all_to_all == "hierarchical":
            intra, inter, per_node, nodes = build_hierarchical_groups(group, ranks_per_node)
            # One rank per node, or one node: one of the two hops has one rank, and the other is the flat exchange.
            self.exchange = FlatExchange(group, timer) if 1 in (per_node, nodes) else \
                HierarchicalExchange(group, intra, inter, per_node, nodes, timer)
        else:
            self.exchange = FlatExchange(group, timer)

    def capacity(self, num_pairs: int) -> int:
        return math.ceil(self.capacity_factor * num_pairs / self.num_experts)

    def dispatch(self, x_ND: torch.Tensor, token_index_C: torch.Tensor, expert_C: torch.Tensor,
                 gate_C: torch.Tensor | None = None, every_token: bool = False) -> tuple[torch.Tensor, DispatchState]:
        """Sends row x[token_index_C[p]] to expert expert_C[p] for every (token, expert) pair p: the arrived
        pairs' rows [M, D], grouped by local expert. `gate_C` ranks the copies for dropping in capacity mode;
        `every_token`: see dispatch_rows."""
        rows_RD, state = self.dispatch_rows(x_ND, token_index_C, expert_C, gate_C, every_token)
        return rows_RD.index_select(0, state.arrived_row_M), state

    def dispatch_rows(self, x_ND: torch.Tensor, token_index_C: torch.Tensor, expert_C: torch.Tensor,
                      gate_C: torch.Tensor | None = None, every_token: bool = False
                      ) -> tuple[torch.Tensor, DispatchState]:
        """As `dispatch`, but returns the R arrived rows (one per (token, rank)); pair m reads row
        state.arrived_row_M[m]. `every_token`: the caller knows every token has a pair (top-k gates); with one rank
        and dropless dispatch the rows are then the tokens themselves, and `_local_rows` sorts the pairs without
        reading the device (the state's host counts are None)."""
        if every_token and not self.drops and isinstance(self.exchange, LocalExchange):
            return x_ND, self._local_rows(x_ND.shape[0], token_index_C, expert_C)
        num_tokens = x_ND.shape[0]
        if self.drops:
            if gate_C is None:
                raise ValueError("capacity dispatch (or a rank budget) needs the gates to decide which copies to drop")
            keep = self._keep_highest_gates if self.mode == "capacity" else self._keep_within_rank_budget
            marks = self._mark(num_tokens, token_index_C, expert_C, *keep(expert_C, gate_C.detach()))
        else:
            marks = self._mark(num_tokens, token_index_C, expert_C)
        # Counts of pairs (per local expert) and rows (per rank) travel together; the one host read.
        pair_route, row_route = self.exchange.plan(marks.counts())
        unique_token_U = marks.rows(row_route)
        rows_are_tokens = isinstance(self.exchange, LocalExchange) and row_route.num_sent == num_tokens
        arrived_rows_RD = x_ND if rows_are_tokens else self.exchange.move(x_ND.index_select(0, unique_token_U),
                                                                           row_route)
        row_in_message_M = self.exchange.move(marks.row_in_message(pair_route), pair_route, regroup=False)[:, 0]
        return arrived_rows_RD, self._state(marks, unique_token_U, pair_route, row_route, row_in_message_M,
                                            rows_are_tokens)

    @property
    def exchanges(self) -> bool:
        """Whether rows travel (more than one expert-parallel rank): only then is there anything to overlap."""
        return not isinstance(self.exchange, LocalExchange)

    def dispatch_pieces(self, x_ND: torch.Tensor, token_index_C: torch.Tensor, expert_C: torch.Tensor,
                        gate_C: torch.Tensor, chunks: int) -> "CountedPieces":
        """dispatch_rows in `chunks` pieces of consecutive tokens, every piece started (moe/dispatch/pieces.py).
        The pairs are a top-k gate's: every token's k pairs, token-major. A rank budget's drops are decided over
        all the pairs first, so the same copies drop as in one piece."""
        num_tokens = x_ND.shape[0]
        k = expert_C.shape[0] // max(num_tokens, 1)
        dropped_C = self._over_rank_budget(expert_C, gate_C.detach()) if self.drops else None
        marks = []
        for first, last in chunk_bounds(num_tokens, chunks):
            pairs = slice(first * k, last * k)
            tokens, experts = token_index_C[pairs] - first, expert_C[pairs]
            if dropped_C is None:
                marks.append(self._mark(last - first, tokens, experts))
                continue
            expert_or_past = experts.masked_fill(dropped_C[pairs], self.num_experts)
            order = torch.argsort(expert_or_past, stable=True)   # kept copies by expert, then the dropped ones
            marks.append(self._mark(last - first, tokens, experts, order, dropped_C[pairs].index_select(0, order),
                                    count_per_bin(expert_or_past, self.num_experts + 1)[:self.num_experts]))
        routes = self.exchange.plan([counts for m in marks for counts in m.counts()])   # the one read
        pieces = []
        for (first, last), m, pair_route, row_route in zip(chunk_bounds(num_tokens, chunks), marks, routes[::2],
                                                           routes[1::2]):
            unique_token_U = m.rows(row_route)
            kept_gates = gate_C[first * k:last * k].index_select(0, m.order_C[:pair_route.num_sent])
            pieces.append(_CountedPiece(self, m, unique_token_U, pair_route, row_route,
                                        self.exchange.start(x_ND[first:last].index_select(0, unique_token_U),
                                                            row_route),
                                        self.exchange.start(m.row_in_message(pair_route), pair_route, regroup=False),
                                        self.exchange.start(kept_gates[:, None], pair_route)))
        return CountedPieces(pieces, num_tokens)

    def _mark(self, num_tokens: int, token_index_C: torch.Tensor, expert_C: torch.Tensor,
              order_C: torch.Tensor | None = None, dropped_C: torch.Tensor | None = None,
              counts_E: torch.Tensor | None = None) -> "_Marks":
        """Everything before the exchange, on the device: the copies sorted (kept ones by expert; `order_C`,
        `dropped_C` (in that order) and `counts_E` where some are dropped), and the rows they need."""
        P, L, device = self.ep_size, self.num_local_experts, expert_C.device
        if order_C is not None:
            # Destination rank of every sorted copy; dropped copies get rank P, past every real row.
            rank_C = torch.div(expert_C.index_select(0, order_C), L, rounding_mode="floor").masked_fill(dropped_C, P)
            key_C = torch.add(token_index_C.index_select(0, order_C), rank_C, alpha=num_tokens)
        else:
            order_C = torch.argsort(expert_C, stable=True)
            counts_E = count_per_bin(expert_C, self.num_experts)
            key_C = torch.add(token_index_C, torch.div(expert_C, L, rounding_mode="floor"), alpha=num_tokens)
            key_C = key_C.index_select(0, order_C)
        # key = (destination rank, token) of every sorted copy. One row per key that a kept copy has, numbered
        # rank-major, then by token: the row all-to-all's order. A mark per (rank, token) and its running count
        # along each rank number them: the count at a copy's key, less one, is its row within that rank's message,
        # and the count at a rank's last token is the rank's rows. (Dropped copies mark an extra rank, never sent.)
        ranks_marked = P + (dropped_C is not None)
        marked_PN = torch.zeros(ranks_marked * num_tokens, dtype=torch.bool, device=device).index_fill_(0, key_C, True)
        running_PN = marked_PN.view(ranks_marked, num_tokens).cumsum(1)
        row_in_message_C = running_PN.view(-1).index_select(0, key_C) - 1
        rows_per_rank_P1 = running_PN[:P, num_tokens - 1:] if num_tokens else running_PN.new_zeros(P, 1)
        return _Marks(order_C, counts_E.view(P, L), rows_per_rank_P1, marked_PN[:P * num_tokens], row_in_message_C,
                      num_tokens, expert_C.shape[0])

    def _state(self, marks: "_Marks", unique_token_U: torch.Tensor, pair_route: Route, row_route: Route,
               row_in_message_M: torch.Tensor, rows_are_tokens: bool) -> DispatchState:
        """The state, once the pairs' rows within their source's message have arrived (`row_in_message_M`, in
        arrival order): each arrived pair's row among all arrived rows."""
        # Arrived rows are grouped by source rank; a pair's row number within its source's message becomes its
        # row among all arrived rows by adding the rows from lower sources (host ints), before the pairs regroup.
        if self.ep_size <= _HOST_OFFSET_RANKS:   # an add per source rank after the first, its offset a host int
            pair_start = row_start = 0
            for pairs_from, rows_from in zip(pair_route.recv_counts, row_route.recv_counts):
                pairs_from = sum(pairs_from)
                if pairs_from and row_start:
                    row_in_message_M[pair_start:pair_start + pairs_from].add_(row_start)
                pair_start, row_start = pair_start + pairs_from, row_start + rows_from[0]
        else:   # the same five launches for any number of ranks
            rows_from_P = row_route.recv_counts_PX[:, 0]
            row_in_message_M.add_(torch.repeat_interleave(rows_from_P.cumsum(0) - rows_from_P,
                                                          pair_route.recv_counts_PX.sum(1),
                                                          output_size=row_in_message_M.shape[0]))
        arrived_row_M = self.exchange.regroup(row_in_message_M, pair_route)
        per_expert = [sum(column) for column in zip(*pair_route.recv_counts)]
        kept = pair_route.num_sent
        return DispatchState(marks.order_C[:kept], unique_token_U, row_route, pair_route, arrived_row_M,
                             row_route.num_arrived, per_expert, pair_route.recv_counts_PX.sum(0), marks.num_tokens,
                             marks.num_pairs - kept, marks.num_pairs, rows_are_tokens)

    def _local_rows(self, num_tokens: int, token_index_C: torch.Tensor, expert_C: torch.Tensor) -> DispatchState:
        """dispatch_rows' state where nothing travels and every token is routed, every pair kept: row u is token u,
        the pairs sorted by expert (stably: each expert's in pair order) read their tokens' rows. The same state as
        the general path's (tests/moe/dispatch), in a few operations, and its sizes known without the counts."""
        num_pairs = expert_C.shape[0]
        order_C = torch.argsort(expert_C, stable=True)
        counts_E = count_per_bin(expert_C, self.num_experts)   # one rank: its local experts are all of them
        pair_route = Route([], None, counts_E[None, :], None, None, num_pairs)
        row_route = Route([], None, counts_E.new_full((1, 1), num_tokens), None, None, num_tokens)
        return DispatchState(order_C, None, row_route, pair_route, token_index_C.index_select(0, order_C), num_tokens,
                             None, counts_E, num_tokens, 0, num_pairs, True)

    def follow(self, values_N: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """values_N[t] (any dtype, e.g. positions) delivered like token t's row by `dispatch`: [M, ...] in the
        order of its tokens_MD, without planning the exchange again."""
        arrived = values_N if state.rows_are_tokens else \
            self.exchange.move(values_N.index_select(0, state.unique_token_U), state.row_route)
        return arrived.index_select(0, state.arrived_row_M)

    def _ranked_within_experts(self, expert_C: torch.Tensor, gate_C: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(order: the copies by expert, then by gate, highest first (ties: the lower pair index); each ordered
        copy's place within its expert; copies per expert): what capacity keeps, the first `capacity` places."""
        num_pairs = expert_C.shape[0]
        by_gate = torch.argsort(gate_C, descending=True, stable=True)
        order_C = by_gate.index_select(0, torch.argsort(expert_C.index_select(0, by_gate), stable=True))
        counts_E = count_per_bin(expert_C, self.num_experts)
        first_of_expert_C = torch.repeat_interleave(counts_E.cumsum(0) - counts_E, counts_E, output_size=num_pairs)
        return order_C, torch.arange(num_pairs, device=expert_C.device) - first_of_expert_C, counts_E

    def _keep_highest_gates(self, expert_C: torch.Tensor, gate_C: torch.Tensor):
        """(order: kept copies by expert, then the dropped ones; which of the ordered copies are dropped;
        kept copies per expert)."""
        order_C, place_C, counts_E = self._ranked_within_experts(expert_C, gate_C)
        capacity = self.capacity(expert_C.shape[0])
        dropped_C = place_C >= capacity
        to_end = torch.argsort(dropped_C.to(torch.uint8), stable=True)   # kept first, each in expert order
        return order_C.index_select(0, to_end), dropped_C.index_select(0, to_end), counts_E.clamp(max=capacity)

    def rank_budget(self, num_pairs: int) -> int:
        """Copies this rank may send to each expert-parallel rank."""
        return math.ceil(self.rank_capacity_factor * num_pairs / self.ep_size)

    def _keep_within_rank_budget(self, expert_C: torch.Tensor, gate_C: torch.Tensor):
        """As _keep_highest_gates, with each destination rank's highest-gate copies kept up to rank_budget."""
        dropped_C = self._over_rank_budget(expert_C, gate_C)
        # kept copies by expert (each expert's in pair order), then the dropped ones
        order_C = torch.argsort(expert_C.masked_fill(dropped_C, self.num_experts), stable=True)
        kept_E = count_per_bin(expert_C.masked_fill(dropped_C, self.num_experts), self.num_experts + 1)
        return order_C, dropped_C.index_select(0, order_C), kept_E[:self.num_experts]

    def _over_rank_budget(self, expert_C: torch.Tensor, gate_C: torch.Tensor) -> torch.Tensor:
        """[C] bool, by pair index: the copies beyond their destination rank's budget (the lowest gates)."""
        num_pairs, L = expert_C.shape[0], self.num_local_experts
        by_gate = torch.argsort(gate_C, descending=True, stable=True)
        rank_by_gate = torch.div(expert_C.index_select(0, by_gate), L, rounding_mode="floor")
        by_rank = by_gate.index_select(0, torch.argsort(rank_by_gate, stable=True))   # by rank, then by gate
        counts_P = count_per_bin(rank_by_gate, self.ep_size)
        first_of_rank = torch.repeat_interleave(counts_P.cumsum(0) - counts_P, counts_P, output_size=num_pairs)
        dropped_by_rank = torch.arange(num_pairs, device=expert_C.device) - first_of_rank >= self.rank_budget(num_pairs)
        return torch.zeros_like(dropped_by_rank).index_copy_(0, by_rank, dropped_by_rank)   # by pair index

    def follow_pairs(self, values_C: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """values_C[p] (one per routed pair, a number or a row of them, any dtype) delivered with pair p: [M] (or
        [M, width]), in the order of the arrived pairs (grouped by local expert), without planning the exchange
        again."""
        sorted_S = values_C.index_select(0, state.sort_order_S)
        if values_C.dim() == 2:
            return self.exchange.move(sorted_S, state.pair_route)
        return self.exchange.move(sorted_S[:, None], state.pair_route)[:, 0]

    def combine(self, y_MD: torch.Tensor, gate_C: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """out[t] = sum over the delivered pairs p of token t of gate_C[p] * (expert output for p)."""
        gates_M1 = self.follow_pairs(gate_C, state).to(y_MD.dtype)[:, None]
        per_row_RD = y_MD.new_zeros(state.num_arrived_rows, y_MD.shape[1]).index_add(
            0, state.arrived_row_M, y_MD * gates_M1)
        return self.combine_rows(per_row_RD, state)

    def dropped_fraction(self, state: DispatchState, data_parallel_group) -> torch.Tensor:
        """Dropped copies / routed copies over the whole data-parallel batch: a device scalar (read with the
        other metrics at log intervals)."""
        counts = torch.empty(2, dtype=torch.float64, device=collective_device())
        counts[0], counts[1] = state.dropped_pairs, state.num_pairs   # fills (a host int, or a device scalar)
        if data_parallel_group is not None and world_size(data_parallel_group) > 1:
            dist.all_reduce(counts, group=data_parallel_group)
        return counts[0] / counts[1].clamp(min=1)

    def combine_rows(self, per_row_RD: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """out[t] = sum of the per-row results of token t's rows, back on this rank: [N, D]."""
        if state.rows_are_tokens:
            return per_row_RD
        back_UD = self.exchange.move_back(per_row_RD, state.row_route)
        return back_UD.new_zeros(state.num_tokens, back_UD.shape[1]).index_add(0, state.unique_token_U, back_UD)


class _CountedPiece:
    """One piece of AllToAllDispatcher.dispatch_pieces: its rows, their metadata and its gates in flight."""

    def __init__(self, dispatcher: AllToAllDispatcher, marks: _Marks, unique_token_U: torch.Tensor, pair_route: Route,
                 row_route: Route, rows: InFlight, row_in_message: InFlight, gates: InFlight):
        self.dispatcher, self.marks, self.unique_token_U = dispatcher, marks, unique_token_U
        self.pair_route, self.row_route = pair_route, row_route
        self._rows, self._row_in_message, self._gates = rows, row_in_message, gates
        self.back: InFlight | None = None

    def land(self):
        state = self.dispatcher._state(self.marks, self.unique_token_U, self.pair_route, self.row_route,
                                       self._row_in_message.land()[:, 0], False)
        return self._rows.land(), state.expert_counts(), state.pair_rows(), self._gates.land()[:, 0]

    def start_back(self, per_row_RD: torch.Tensor) -> None:
        self.back = self.dispatcher.exchange.start_back(per_row_RD, self.row_route)

    def combine(self) -> torch.Tensor:
        back_UD = self.back.land()
        return back_UD.new_zeros(self.marks.num_tokens, back_UD.shape[1]).index_add(0, self.unique_token_U, back_UD)


class CountedPieces:
    """AllToAllDispatcher.dispatch_pieces' pieces (moe/dispatch/pieces.py's Pieces)."""

    def __init__(self, pieces: list[_CountedPiece], num_tokens: int):
        self.pieces, self.num_tokens = pieces, num_tokens
        self.num_pairs = sum(piece.marks.num_pairs for piece in pieces)
        self.dropped_pairs = self.num_pairs - sum(piece.pair_route.num_sent for piece in pieces)

    def __iter__(self):
        return iter(self.pieces)

    def combine(self) -> torch.Tensor:
        return torch.cat([piece.combine() for piece in self.pieces])
