"""Token dispatcher: send each (token, expert) copy to the rank that owns the expert, and bring it back.

Legend: N local tokens, C (token, expert) pairs routed from this rank (N*K for a top-k gate), D model dim,
E global experts, P expert-parallel ranks, L = E / P local experts per rank, M pairs that arrive here.

Expert e lives on EP rank e // L. Memory grows with N*K, never with N*E: no dense dispatch mask, no
[tokens, experts, capacity] tensor.

    dispatch:  sort the copies by expert (capacity mode: by expert, then by gate, highest first, and drop
               each expert's copies beyond its capacity) ─▶ the exchange (moe/exchange.py: counts, then a
               variable-size all-to-all of rows, flat or hierarchical) ─▶ rows grouped by local expert
    combine:   the exchange's reverse, then scale by the gates and sum each token's copies

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

from moe_scale.distributed.comm import world_size
from moe_scale.moe.exchange import FlatExchange, LocalExchange

MODES = ("dropless", "capacity")


@dataclass
class DispatchState:
    """What `combine` needs to undo `dispatch`."""

    sort_order_S: torch.Tensor          # S pairs sent (all C in dropless mode), expert-sorted -> pair index
    token_index_S: torch.Tensor         # token of each sent pair
    handle: object                      # the exchange's state for the way back
    tokens_per_expert: list[int]        # rows per local expert after the exchange
    num_tokens: int
    dropped_pairs: int                  # copies this rank dropped (capacity mode)
    num_pairs: int                      # copies this rank routed


class AllToAllDispatcher:
    """All-to-all dispatch over an expert-parallel group; `exchange` is set by the layer once groups exist."""

    def __init__(self, num_experts: int, num_local_experts: int, mode: str = "dropless",
                 capacity_factor: float = 1.0):
        if mode not in MODES:
            raise ValueError(f"dispatch mode must be one of {MODES}, got {mode!r}")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
        self.num_experts, self.num_local_experts = num_experts, num_local_experts
        self.ep_size = num_experts // num_local_experts
        self.mode, self.capacity_factor = mode, capacity_factor
        self.exchange = LocalExchange()

    @property
    def ep_group(self):
        """The expert-parallel group rows travel over (None until connected)."""
        return self.exchange.group

    @ep_group.setter
    def ep_group(self, group) -> None:
        """Connect with one flat all-to-all over `group` (the layer may install a hierarchical exchange)."""
        timer = self.exchange.timer
        self.exchange = FlatExchange(group, timer) if world_size(group) > 1 else LocalExchange(timer)

    def capacity(self, num_pairs: int) -> int:
        return math.ceil(self.capacity_factor * num_pairs / self.num_experts)

    def dispatch(self, x_ND: torch.Tensor, token_index_C: torch.Tensor, expert_C: torch.Tensor,
                 gate_C: torch.Tensor | None = None) -> tuple[torch.Tensor, DispatchState]:
        """Sends row x[token_index_C[p]] to expert expert_C[p] for every (token, expert) pair p.
        `gate_C` ranks the copies for dropping in capacity mode (unused when dropless)."""
        num_pairs = expert_C.shape[0]
        if self.mode == "capacity":
            if gate_C is None:
                raise ValueError("capacity dispatch needs the gates to decide which copies to drop")
            sort_order_S, counts_E = self._keep_highest_gates(expert_C, gate_C.detach())
        else:
            sort_order_S = torch.argsort(expert_C, stable=True)
            counts_E = torch.bincount(expert_C, minlength=self.num_experts)
        token_index_S = token_index_C.index_select(0, sort_order_S)
        rows_SD = x_ND.index_select(0, token_index_S)
        tokens_MD, tokens_per_expert, handle = self.exchange.send(
            rows_SD, counts_E.view(self.ep_size, self.num_local_experts))
        state = DispatchState(sort_order_S, token_index_S, handle, tokens_per_expert, x_ND.shape[0],
                              num_pairs - sort_order_S.shape[0], num_pairs)
        return tokens_MD, state

    def _keep_highest_gates(self, expert_C: torch.Tensor, gate_C: torch.Tensor):
        by_gate = torch.argsort(gate_C, descending=True, stable=True)
        order_C = by_gate.index_select(0, torch.argsort(expert_C.index_select(0, by_gate), stable=True))
        counts_E = torch.bincount(expert_C, minlength=self.num_experts)
        first_of_expert_C = torch.repeat_interleave(counts_E.cumsum(0) - counts_E, counts_E)
        rank_in_expert_C = torch.arange(order_C.shape[0], device=order_C.device) - first_of_expert_C
        capacity = self.capacity(expert_C.shape[0])
        return order_C[rank_in_expert_C < capacity], counts_E.clamp(max=capacity)

    def combine(self, y_MD: torch.Tensor, gate_C: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """out[t] = sum over the delivered pairs p of token t of gate_C[p] * (expert output for p)."""
        y_SD = self.exchange.send_back(y_MD, state.handle)
        gates_S = gate_C.index_select(0, state.sort_order_S).to(y_SD.dtype)
        out_ND = y_SD.new_zeros(state.num_tokens, y_SD.shape[1])
        return out_ND.index_add(0, state.token_index_S, y_SD * gates_S[:, None])
