"""Capacity dispatch with every size known before the step: the exchange reads nothing from the device.

Legend (docs/shapes.md): N tokens on this rank, C (token, expert) pairs routed from this rank, D model width,
E experts over all ranks, P expert-parallel ranks, L = E / P local experts per rank, S = E * cap slots this rank
sends (cap: an expert's capacity per sending rank), M = L * P * cap slots that arrive here.

GShard's layout: each expert takes exactly `cap` = ceil(capacity_factor * C / E) slots from each rank. Copies are
kept as AllToAllDispatcher's capacity mode keeps them (per expert, the highest gates; ties: the lower pair index);
an expert with fewer copies has empty slots, which carry a zero row and a zero gate. Every message is then
L * cap rows from every rank to every rank, a size the host knows from the shapes alone, so the step makes no
count exchange and no device-to-host read (tools/count_step_syncs.py --dispatch capacity); each local expert
receives exactly P * cap rows, so the experts' grouped products have sizes the host knows too.

The price is the empty slots: an expert computes its full capacity whatever it received, and a slot is one pair
(a token with two experts on one rank crosses twice, where the counting dispatcher sends one row). With
capacity_factor 1 and balanced routing the slots are about the pairs; docs/capacity.md says when to choose which.

The outputs equal AllToAllDispatcher's capacity mode (tests/moe/dispatch/test_static_capacity.py): the same copies
kept, each token's outputs summed in the same order (by expert). The MoE layer with a flat gate uses this class in
capacity mode (moe/dispatch/__init__.py's build_dispatcher); the hierarchical gate's layer routes within its
groups after the exchange and keeps the counting dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_scale.moe.dispatch.dispatcher import AllToAllDispatcher
from moe_scale.moe.dispatch.exchange import InFlight, Route
from moe_scale.moe.dispatch.pieces import chunk_bounds
from moe_scale.moe.expert_counts import ExpertCounts


@dataclass
class StaticDispatchState:
    """What `combine_rows` and `follow_pairs` need: where each slot's pair and token came from."""

    route: Route
    pair_of_slot_S: torch.Tensor    # the pair in each sent slot; C for an empty slot
    token_of_slot_S: torch.Tensor   # its token; N for an empty slot
    slots_per_expert: int           # P * cap: what each local expert receives
    num_local_experts: int
    num_tokens: int
    num_pairs: int
    dropped_pairs: torch.Tensor     # device scalar: copies over capacity

    def expert_counts(self) -> ExpertCounts:
        return _slots_per_expert(self.num_local_experts, self.slots_per_expert, self.token_of_slot_S.device)

    def pair_rows(self) -> None:
        """Each arrived slot is its own row: None (the experts then return one output per slot)."""
        return None


class StaticCapacityDispatcher(AllToAllDispatcher):
    """AllToAllDispatcher's capacity mode with slots of a fixed size (see the module docstring)."""

    def __init__(self, num_experts: int, num_local_experts: int, capacity_factor: float = 1.0):
        super().__init__(num_experts, num_local_experts, "capacity", capacity_factor)

    def dispatch_rows(self, x_ND: torch.Tensor, token_index_C: torch.Tensor, expert_C: torch.Tensor,
                      gate_C: torch.Tensor | None = None, every_token: bool = False
                      ) -> tuple[torch.Tensor, StaticDispatchState]:
        """The M slots' rows that arrive here, grouped by local expert (P * cap each, by source rank within)."""
        slots = self._slots(x_ND, token_index_C, expert_C, gate_C)
        route = self.exchange.plan_uniform(self.num_local_experts, slots.cap, x_ND.device)
        rows_SD = _with_one_more(x_ND, 0).index_select(0, slots.token_of_slot_S)
        state = StaticDispatchState(route, slots.pair_of_slot_S, slots.token_of_slot_S, route_slots(route, slots.cap),
                                    self.num_local_experts, x_ND.shape[0], expert_C.shape[0], slots.dropped_pairs)
        return self.exchange.move(rows_SD, route), state

    def _slots(self, x_ND: torch.Tensor, token_index_C: torch.Tensor, expert_C: torch.Tensor,
               gate_C: torch.Tensor | None) -> "_Slots":
        if gate_C is None:
            raise ValueError("capacity dispatch needs the gates to decide which copies to drop")
        num_tokens, num_pairs, E = x_ND.shape[0], expert_C.shape[0], self.num_experts
        cap, device = self.capacity(num_pairs), x_ND.device
        order_C, place_C, _ = self._ranked_within_experts(expert_C, gate_C.detach())
        kept_C = place_C < cap
        # Slot e * cap + place for a kept copy; a dropped one goes past the S slots (each to its own place).
        slot_C = torch.where(kept_C, expert_C.index_select(0, order_C) * cap + place_C,
                             E * cap + torch.arange(num_pairs, device=device))
        pair_of_slot = torch.full((E * cap + num_pairs,), num_pairs, dtype=torch.long, device=device)
        pair_of_slot_S = pair_of_slot.index_copy_(0, slot_C, order_C)[:E * cap]
        token_of_slot_S = _with_one_more(token_index_C, num_tokens).index_select(0, pair_of_slot_S)
        return _Slots(cap, pair_of_slot_S, token_of_slot_S, (~kept_C).sum())

    def dispatch_pieces(self, x_ND: torch.Tensor, token_index_C: torch.Tensor, expert_C: torch.Tensor,
                        gate_C: torch.Tensor, chunks: int) -> "SlotPieces":
        """The slots in `chunks` pieces along each expert's capacity (piece c: places [c cap / C, (c+1) cap / C)
        of every expert), every piece started (moe/dispatch/pieces.py); no read, as in one piece."""
        slots = self._slots(x_ND, token_index_C, expert_C, gate_C)
        E, cap, D = self.num_experts, slots.cap, x_ND.shape[1]
        rows_ECD = _with_one_more(x_ND, 0).index_select(0, slots.token_of_slot_S).view(E, cap, D)
        gates_EC = _with_one_more(gate_C, 0).index_select(0, slots.pair_of_slot_S).view(E, cap)
        pieces = []
        for first, last in chunk_bounds(cap, chunks):
            if first == last:
                continue
            route = self.exchange.plan_uniform(self.num_local_experts, last - first, x_ND.device)
            pieces.append(_SlotPiece(self, route, route_slots(route, last - first),
                                     self.exchange.start(rows_ECD[:, first:last].reshape(-1, D), route),
                                     self.exchange.start(gates_EC[:, first:last].reshape(-1, 1), route)))
        return SlotPieces(pieces, slots, x_ND.shape[0], expert_C.shape[0], E)

    def dispatch(self, x_ND, token_index_C, expert_C, gate_C=None, every_token=False):
        return self.dispatch_rows(x_ND, token_index_C, expert_C, gate_C, every_token)

    def follow_pairs(self, values_C: torch.Tensor, state: StaticDispatchState) -> torch.Tensor:
        """values_C[p] delivered with pair p's slot (0 in an empty slot): [M]."""
        slots_S = _with_one_more(values_C, 0).index_select(0, state.pair_of_slot_S)
        return self.exchange.move(slots_S[:, None], state.route)[:, 0]

    def follow(self, values_N: torch.Tensor, state: StaticDispatchState) -> torch.Tensor:
        """values_N[t] delivered with each of token t's slots (0 in an empty slot): [M, ...]."""
        return self.exchange.move(_with_one_more(values_N, 0).index_select(0, state.token_of_slot_S), state.route)

    def combine(self, y_MD: torch.Tensor, gate_C: torch.Tensor, state: StaticDispatchState) -> torch.Tensor:
        return self.combine_rows(y_MD * self.follow_pairs(gate_C, state).to(y_MD.dtype)[:, None], state)

    def combine_rows(self, per_row_MD: torch.Tensor, state: StaticDispatchState) -> torch.Tensor:
        """out[t] = the sum of token t's slots' results, back on this rank: [N, D] (empty slots add to a row
        past the last, left out)."""
        back_SD = self.exchange.move_back(per_row_MD, state.route)
        return back_SD.new_zeros(state.num_tokens + 1, back_SD.shape[1]).index_add(
            0, state.token_of_slot_S, back_SD)[:state.num_tokens]

@dataclass
class _Slots:
    cap: int
    pair_of_slot_S: torch.Tensor
    token_of_slot_S: torch.Tensor
    dropped_pairs: torch.Tensor


class _SlotPiece:
    """One piece of StaticCapacityDispatcher.dispatch_pieces."""

    def __init__(self, dispatcher: StaticCapacityDispatcher, route: Route, slots_per_expert: int, rows: InFlight,
                 gates: InFlight):
        self.dispatcher, self.route, self.slots_per_expert = dispatcher, route, slots_per_expert
        self._rows, self._gates = rows, gates
        self.back: InFlight | None = None

    def land(self):
        rows_MD = self._rows.land()
        counts = _slots_per_expert(self.dispatcher.num_local_experts, self.slots_per_expert, rows_MD.device)
        return rows_MD, counts, None, self._gates.land()[:, 0]

    def start_back(self, per_row_MD: torch.Tensor) -> None:
        self.back = self.dispatcher.exchange.start_back(per_row_MD, self.route)


class SlotPieces:
    """StaticCapacityDispatcher.dispatch_pieces' pieces (moe/dispatch/pieces.py's Pieces)."""

    def __init__(self, pieces: list[_SlotPiece], slots: _Slots, num_tokens: int, num_pairs: int, num_experts: int):
        self.pieces, self.slots, self.num_tokens, self.num_experts = pieces, slots, num_tokens, num_experts
        self.num_pairs, self.dropped_pairs = num_pairs, slots.dropped_pairs

    def __iter__(self):
        return iter(self.pieces)

    def combine(self) -> torch.Tensor:
        """The pieces' slots put back in one piece's order, each token's results then added as one piece adds them."""
        back = [piece.back.land() for piece in self.pieces]
        if not back:   # no pairs, no slots
            return self.slots.token_of_slot_S.new_zeros(0)
        D = back[0].shape[1]
        back_SD = torch.cat([b.view(self.num_experts, -1, D) for b in back], dim=1).view(-1, D)
        return back_SD.new_zeros(self.num_tokens + 1, D).index_add(0, self.slots.token_of_slot_S, back_SD)[
            :self.num_tokens]


def _slots_per_expert(num_local_experts: int, slots: int, device: torch.device) -> ExpertCounts:
    """Every local expert's rows: `slots`, on the device and known to the host."""
    return ExpertCounts(torch.full((num_local_experts,), slots, dtype=torch.long, device=device),
                        [slots] * num_local_experts)


def route_slots(route: Route, cap: int) -> int:
    """Slots each local expert receives: cap from every source rank."""
    return len(route.recv_counts) * cap


def _with_one_more(values: torch.Tensor, fill) -> torch.Tensor:
    """`values` with one more entry (row) at the end, `fill` (zeros for rows): what an empty slot reads."""
    return torch.cat([values, values.new_full((1, *values.shape[1:]), fill)])
