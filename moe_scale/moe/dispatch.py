"""Token dispatcher: send each (token, expert) copy to the rank that owns the expert, and bring it back.

Legend: N local tokens, C (token, expert) pairs routed from this rank (N*K for a top-k gate), D model dim,
E global experts, P expert-parallel ranks, L = E / P local experts per rank, M pairs that arrive here.

Dropless: every copy is delivered; memory grows with N*K, never with N*E. Expert e lives on EP rank e // L.

    dispatch:  sort the N*K copies by expert ─▶ exchange per-expert counts (all-to-all on [P, L] ints)
               ─▶ variable-size all-to-all of the rows ─▶ regroup arrivals from (source, expert) order to
               (expert, source) order, so each local expert's rows are contiguous
    combine:   the exact reverse, then scale by the gates and sum each token's K copies

A dispatcher never knows how gates were chosen; it only sees expert ids and gate values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd


@dataclass
class DispatchState:
    """What `combine` needs to undo `dispatch`."""

    sort_order_C: torch.Tensor          # position in the expert-sorted list -> pair index
    token_index_C: torch.Tensor         # token of each pair, in expert-sorted order
    send_splits: list[int]              # rows sent to each EP rank
    recv_splits: list[int]              # rows received from each EP rank
    regroup_M: torch.Tensor | None      # arrival order -> expert-grouped order (None when P == 1)
    tokens_per_expert: list[int]        # rows per local expert after regrouping
    num_tokens: int


class AllToAllDispatcher:
    """Dropless all-to-all dispatch over an expert-parallel group (or local when the group is None)."""

    def __init__(self, num_experts: int, num_local_experts: int):
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size = num_experts // num_local_experts

    def dispatch(self, x_ND: torch.Tensor, token_index_P: torch.Tensor,
                 expert_P: torch.Tensor) -> tuple[torch.Tensor, DispatchState]:
        """Sends row x[token_index_P[p]] to expert expert_P[p] for every (token, expert) pair p."""
        num_tokens = x_ND.shape[0]
        sort_order_C = torch.argsort(expert_P, stable=True)
        token_index_C = token_index_P.index_select(0, sort_order_C)
        rows_CD = x_ND.index_select(0, token_index_C)
        counts_E = torch.bincount(expert_P, minlength=self.num_experts)

        if self.ep_size == 1:
            tokens_per_expert = counts_E.tolist()
            state = DispatchState(sort_order_C, token_index_C, [rows_CD.shape[0]], [rows_CD.shape[0]], None,
                                  tokens_per_expert, num_tokens)
            return rows_CD, state

        P, L = self.ep_size, self.num_local_experts
        send_counts_PL = counts_E.view(P, L)
        recv_counts_PL = torch.empty_like(send_counts_PL)
        dist.all_to_all_single(recv_counts_PL, send_counts_PL, group=self.ep_group)
        send_splits = send_counts_PL.sum(1).tolist()
        recv_splits = recv_counts_PL.sum(1).tolist()
        arrived_MD = _all_to_all(rows_CD, recv_splits, send_splits, self.ep_group)
        regroup_M = _source_major_to_expert_major(recv_counts_PL)
        state = DispatchState(sort_order_C, token_index_C, send_splits, recv_splits, regroup_M,
                              recv_counts_PL.sum(0).tolist(), num_tokens)
        return arrived_MD.index_select(0, regroup_M), state

    def combine(self, y_MD: torch.Tensor, gate_P: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """out[t] = sum over the pairs p of token t of gate_P[p] * (expert output for p)."""
        if state.regroup_M is not None:
            back_MD = torch.empty_like(y_MD).index_copy(0, state.regroup_M, y_MD)   # undo the regrouping
            y_MD = _all_to_all(back_MD, state.send_splits, state.recv_splits, self.ep_group)
        gates_C = gate_P.index_select(0, state.sort_order_C).to(y_MD.dtype)
        out_ND = y_MD.new_zeros(state.num_tokens, y_MD.shape[1])
        return out_ND.index_add(0, state.token_index_C, y_MD * gates_C[:, None])


def _all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Autograd-aware variable-size all-to-all (the backward is the reverse exchange)."""
    out = rows.new_empty(sum(out_splits), rows.shape[1])
    return dist_autograd.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_splits,
                                           input_split_sizes=in_splits, group=group)


def _source_major_to_expert_major(counts_PL: torch.Tensor) -> torch.Tensor:
    """Index that reorders rows laid out as (source rank, local expert) blocks into (local expert, source rank).

    counts_PL[p, l] rows came from rank p for local expert l; returns regroup_M with
    grouped[i] = arrived[regroup_M[i]].
    """
    P, L = counts_PL.shape
    block_start_PL = (counts_PL.reshape(-1).cumsum(0) - counts_PL.reshape(-1)).view(P, L)
    starts_LP = block_start_PL.t().reshape(-1)          # block starts in the wanted (expert, source) order
    sizes_LP = counts_PL.t().reshape(-1)
    within = torch.arange(int(sizes_LP.sum()), device=counts_PL.device) - torch.repeat_interleave(
        sizes_LP.cumsum(0) - sizes_LP, sizes_LP)
    return torch.repeat_interleave(starts_LP, sizes_LP) + within
