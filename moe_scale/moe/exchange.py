"""Row exchanges between expert-parallel ranks: what moves the dispatcher's rows over the network.

Legend: C rows this rank sends (sorted by destination global expert), D row width, P expert-parallel ranks,
L local experts per rank, M rows that arrive here, S ranks per node, Q = P / S nodes.

An exchange plans a `Route` from the counts of rows per (destination rank, local expert) — counts are
exchanged once — and then `move`s any tensor whose rows are sorted that way (token rows, int metadata,
gates): the rows that arrive here come out grouped by local expert (expert-major, then source rank, then
the sender's order). `move_back` is its exact reverse. Every step is a permutation or an autograd-aware
all-to-all, so gradients flow both ways.

    LocalExchange         P == 1: nothing moves.
    FlatExchange          one all-to-all of counts, one variable-size all-to-all of rows over the EP group.
    HierarchicalExchange  first within the node, to the rank with the destination's local index; then across
                          nodes among the ranks with that local index. Each row crosses the network once, and
                          a rank exchanges inter-node messages with Q peers instead of P, each S times larger.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


class CommTimer:
    """Seconds spent in all-to-all calls (forward and backward), for the all-to-all share of a step."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def run(self, fn, device: torch.device):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()   # GPU work queued before the call is not communication
        start = time.perf_counter()
        out = fn()
        sync()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def _all_to_all_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


class _TimedAllToAll(torch.autograd.Function):
    """Variable-size all-to-all whose backward is the reverse exchange; both directions are timed."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group, timer):
        ctx.splits, ctx.group, ctx.timer = (out_splits, in_splits), group, timer
        return timer.run(lambda: _all_to_all_rows(rows, out_splits, in_splits, group), rows.device)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = ctx.timer.run(lambda: _all_to_all_rows(grad, in_splits, out_splits, ctx.group), grad.device)
        return back, None, None, None, None


def all_to_all_rows(rows, out_splits: list[int], in_splits: list[int], group, timer: CommTimer):
    return _TimedAllToAll.apply(rows, out_splits, in_splits, group, timer)


def exchange_counts(send_AB: torch.Tensor, group, timer: CommTimer) -> torch.Tensor:
    """Row a of `send_AB` goes to rank a of `group`; returns row b = what rank b sent here."""
    recv_AB = torch.empty_like(send_AB)
    timer.run(lambda: dist.all_to_all_single(recv_AB, send_AB.contiguous(), group=group), send_AB.device)
    return recv_AB


def block_transpose_index(counts_AB: torch.Tensor) -> torch.Tensor:
    """Rows laid out as blocks in (a, b) order, block (a, b) holding counts_AB[a, b] rows; returns idx with
    rows[idx] laid out in (b, a) order, each block's rows kept in their order."""
    A, B = counts_AB.shape
    sizes = counts_AB.reshape(-1)
    block_start_AB = (sizes.cumsum(0) - sizes).view(A, B)
    starts_BA = block_start_AB.t().reshape(-1)
    sizes_BA = counts_AB.t().reshape(-1)
    within = torch.arange(int(sizes_BA.sum()), device=counts_AB.device) - torch.repeat_interleave(
        sizes_BA.cumsum(0) - sizes_BA, sizes_BA)
    return torch.repeat_interleave(starts_BA, sizes_BA) + within


def _unpermute(rows: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Inverse of rows[perm] (autograd-aware)."""
    return torch.empty_like(rows).index_copy(0, perm, rows)


@dataclass
class _Stage:
    """One all-to-all hop: splits in both directions and the permutation applied before sending."""

    group: object
    send_splits: list[int]
    recv_splits: list[int]
    order_before_send: torch.Tensor | None


@dataclass
class Route:
    """How rows with given per-(destination rank, local expert) counts travel, planned once, used for every
    tensor that follows the same rows (token rows, their metadata, their gates)."""

    stages: list[_Stage]
    regroup_M: torch.Tensor | None      # arrival order -> (local expert, source rank) order
    recv_counts_PL: torch.Tensor        # rows that arrive from each source rank for each local expert


class _Exchange:
    """move / move_back for any plan; subclasses plan the hops."""

    timer: CommTimer

    def move(self, rows: torch.Tensor, route: Route) -> torch.Tensor:
        """Rows sorted by (destination rank, local expert) -> the rows that arrive here, expert-major."""
        for stage in route.stages:
            if stage.order_before_send is not None:
                rows = rows.index_select(0, stage.order_before_send)
            rows = all_to_all_rows(rows, stage.recv_splits, stage.send_splits, stage.group, self.timer)
        return rows if route.regroup_M is None else rows.index_select(0, route.regroup_M)

    def move_back(self, rows: torch.Tensor, route: Route) -> torch.Tensor:
        """The exact reverse of `move`."""
        if route.regroup_M is not None:
            rows = _unpermute(rows, route.regroup_M)
        for stage in reversed(route.stages):
            rows = all_to_all_rows(rows, stage.send_splits, stage.recv_splits, stage.group, self.timer)
            if stage.order_before_send is not None:
                rows = _unpermute(rows, stage.order_before_send)
        return rows


class LocalExchange(_Exchange):
    def __init__(self, timer: CommTimer | None = None, group=None):
        self.group, self.timer = group, timer or CommTimer()

    def plan(self, counts_PL: torch.Tensor) -> Route:
        return Route([], None, counts_PL)


class FlatExchange(_Exchange):
    def __init__(self, group, timer: CommTimer | None = None):
        self.group, self.timer = group, timer or CommTimer()

    def plan(self, counts_PL: torch.Tensor) -> Route:
        recv_counts_PL = exchange_counts(counts_PL, self.group, self.timer)
        stage = _Stage(self.group, counts_PL.sum(1).tolist(), recv_counts_PL.sum(1).tolist(), None)
        # Rows arrive as (source, expert) blocks; regroup to (expert, source).
        return Route([stage], block_transpose_index(recv_counts_PL), recv_counts_PL)


class HierarchicalExchange(_Exchange):
    """Two hops for P = Q nodes x S ranks per node (EP rank = node * S + local index)."""

    def __init__(self, group, intra_group, inter_group, ranks_per_node: int, num_nodes: int,
                 timer: CommTimer | None = None):
        self.group, self.intra_group, self.inter_group = group, intra_group, inter_group
        self.S, self.Q = ranks_per_node, num_nodes
        self.timer = timer or CommTimer()

    def plan(self, counts_PL: torch.Tensor) -> Route:
        S, Q, L = self.S, self.Q, counts_PL.shape[1]
        counts_QSL = counts_PL.view(Q, S, L)
        # Hop 1, inside the node: to the rank whose local index is the destination's; order (s', q', l).
        order1 = block_transpose_index(counts_QSL.sum(2))
        send1_SQL = counts_QSL.transpose(0, 1).contiguous()
        recv1_SQL = exchange_counts(send1_SQL.view(S, Q * L), self.intra_group, self.timer).view(S, Q, L)
        hop1 = _Stage(self.intra_group, send1_SQL.sum((1, 2)).tolist(), recv1_SQL.sum((1, 2)).tolist(), order1)
        # Hop 2, across nodes: arrived in (source s, q', l) order; regroup to (q', s, l) and send to node q'.
        order2 = block_transpose_index(recv1_SQL.sum(2))
        send2_QSL = recv1_SQL.transpose(0, 1).contiguous()
        recv2_QSL = exchange_counts(send2_QSL.view(Q, S * L), self.inter_group, self.timer).view(Q, S, L)
        hop2 = _Stage(self.inter_group, send2_QSL.sum((1, 2)).tolist(), recv2_QSL.sum((1, 2)).tolist(), order2)
        # Arrived in (source node, source local index, l) = (source EP rank, l) order, exactly as a flat
        # exchange delivers: the same regrouping makes each local expert's rows contiguous.
        recv_counts_PL = recv2_QSL.view(Q * S, L)
        return Route([hop1, hop2], block_transpose_index(recv_counts_PL), recv_counts_PL)


def build_hierarchical_groups(ep_group, ranks_per_node: int) -> tuple[object, object, int, int]:
    """(intra_group, inter_group, S, Q) for this rank's expert-parallel group.

    Collective over the whole world: every rank creates every subgroup in the same order (torch requires it).
    An EP group of P ranks spans Q = P / S nodes; it must be made of whole nodes' worth of consecutive ranks.
    """
    ep_ranks = dist.get_process_group_ranks(ep_group)
    P, S = len(ep_ranks), min(ranks_per_node, len(ep_ranks))
    if P % S:
        raise ValueError(f"hierarchical all-to-all: {ranks_per_node} ranks per node do not divide the "
                         f"expert-parallel size {P}")
    all_ep_groups: list[list[int]] = [None] * dist.get_world_size()   # type: ignore[list-item]
    dist.all_gather_object(all_ep_groups, ep_ranks)
    intra = inter = None
    for ranks in sorted({tuple(g) for g in all_ep_groups}):
        for q in range(P // S):
            group = dist.new_group(list(ranks[q * S:(q + 1) * S]))
            if dist.get_rank() in ranks[q * S:(q + 1) * S]:
                intra = group
        for s in range(S):
            group = dist.new_group(list(ranks[s::S]))
            if dist.get_rank() in ranks[s::S]:
                inter = group
    return intra, inter, S, P // S
