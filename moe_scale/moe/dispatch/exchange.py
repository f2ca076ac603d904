"""Row exchanges between expert-parallel ranks: what moves the dispatcher's rows over the network.

Legend (docs/shapes.md): P expert-parallel ranks, X count columns (streams side by side: L local experts of
pairs, one of rows), W ranks per node, Q = P / W nodes, D row width.

An exchange plans `Route`s from counts of rows per (destination rank, column) — one count exchange per
hop for all streams together, then ONE read of every count to the host, the only device-to-host copy of a
layer's step (all_to_all_single takes its split sizes as Python ints; where nothing travels and the dispatcher
knows the sizes, not even that) — and then `move`s any tensor whose
rows are sorted that way (token rows, int metadata, gates): the rows that arrive here come out grouped by
column (column-major, then source rank, then the sender's order). `move_back` is its exact reverse, and
reuses the split sizes read in the forward. Every step is a permutation or an autograd-aware all-to-all; a
permutation that is the identity whatever the counts (one column of a stream, such as the rows; one block row or
column of a hop) is skipped, decided from shapes the host knows, never from the counts.

    LocalExchange         P == 1: nothing moves.
    FlatExchange          one all-to-all of counts, one variable-size all-to-all of rows over the EP group.
    HierarchicalExchange  first within the node, to the rank with the destination's local index; then across
                          nodes among the ranks with that local index. Each row crosses the network once, and
                          a rank exchanges inter-node messages with Q peers instead of P, each W times larger.

All-to-all time: on a GPU, CUDA events around each call, read when asked (at log intervals), so timing
never synchronises the device; on CPU, the wall time of each call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_MAX_PENDING_EVENTS = 4096


class CommTimer:
    """Seconds spent in all-to-all calls (forward and backward), for the all-to-all share of a step."""

    def __init__(self):
        self._seconds, self.calls = 0.0, 0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def reset(self) -> None:
        self._seconds, self.calls, self._pending = 0.0, 0, []

    @property
    def seconds(self) -> float:
        """Waits for the calls recorded so far to finish (once per log interval, not per call)."""
        for start, end in self._pending:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000.0
        self._pending = []
        return self._seconds

    def wait(self, work, device: torch.device) -> None:
        """Waits for an asynchronous exchange: the time counted is what the wait exposes (on a GPU the compute
        stream's wait, between events; on CPU the host's)."""
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work.wait()
            end.record()
            self._pending.append((start, end))
            return
        began = time.perf_counter()
        work.wait()
        self._seconds += time.perf_counter() - began

    def run(self, fn, device: torch.device):
        self.calls += 1
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self._pending.append((start, end))
            if len(self._pending) > _MAX_PENDING_EVENTS:   # nobody reads: fold in the finished ones
                self._fold_finished()
            return out
        began = time.perf_counter()
        out = fn()
        self._seconds += time.perf_counter() - began
        return out

    def _fold_finished(self) -> None:
        keep = []
        for start, end in self._pending:
            if end.query():
                self._seconds += start.elapsed_time(end) / 1000.0
            else:
                keep.append((start, end))
        self._pending = keep


def all_to_all_plain(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """One variable-size all-to-all of rows (no autograd): `in_splits` rows to each rank, `out_splits` from each."""
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


class _TimedAllToAll(torch.autograd.Function):
    """Variable-size all-to-all whose backward is the reverse exchange; both directions are timed."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group, timer):
        ctx.splits, ctx.group, ctx.timer = (out_splits, in_splits), group, timer
        return timer.run(lambda: all_to_all_plain(rows, out_splits, in_splits, group), rows.device)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = ctx.timer.run(lambda: all_to_all_plain(grad, in_splits, out_splits, ctx.group), grad.device)
        return back, None, None, None, None


def all_to_all_rows(rows, out_splits: list[int], in_splits: list[int], group, timer: CommTimer):
    return _TimedAllToAll.apply(rows, out_splits, in_splits, group, timer)


class _Flight:
    """One all-to-all in flight each way: the forward's work handle and buffer, and the backward's."""

    def __init__(self, out_splits: list[int], in_splits: list[int], group, timer: CommTimer):
        self.splits, self.group, self.timer = (out_splits, in_splits), group, timer
        self.work = self.back_work = self.back = None


def _launch(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    work = dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=True)
    return out, work


class _Launch(torch.autograd.Function):
    """Starts an all-to-all and returns its buffer, to be read only through `_Land` (which waits for it). The
    backward waits for the reverse exchange `_Land`'s backward started, so the backward overlaps as the forward
    does."""

    @staticmethod
    def forward(ctx, rows, flight: _Flight):
        ctx.flight = flight
        out, flight.work = _launch(rows, *flight.splits, flight.group)
        flight.timer.calls += 1
        return out

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        flight.timer.wait(flight.back_work, grad.device)
        back, flight.back, flight.back_work = flight.back, None, None
        return back, None


class _Land(torch.autograd.Function):
    """Waits for `_Launch`'s exchange; the backward starts the reverse one and returns at once."""

    @staticmethod
    def forward(ctx, out, flight: _Flight):
        ctx.flight = flight
        flight.timer.wait(flight.work, out.device)
        flight.work = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        out_splits, in_splits = flight.splits
        flight.back, flight.back_work = _launch(grad, in_splits, out_splits, flight.group)
        flight.timer.calls += 1
        return grad, None


class InFlight:
    """Rows on their way: `land()` waits for them and finishes their route (what follows the asynchronous hop)."""

    def __init__(self, out: torch.Tensor, flight: _Flight | None, then):
        self._out, self._flight, self._then = out, flight, then

    def land(self) -> torch.Tensor:
        rows = self._out if self._flight is None else _Land.apply(self._out, self._flight)
        return self._then(rows)


def start_all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group, timer: CommTimer,
                     then=lambda rows: rows) -> InFlight:
    """An asynchronous, autograd-aware all_to_all_rows: returns at once; `land()` gives the rows, then `then` of
    them."""
    flight = _Flight(out_splits, in_splits, group, timer)
    return InFlight(_Launch.apply(rows, flight), flight, then)


def exchange_counts(send: torch.Tensor, group, timer: CommTimer, out: torch.Tensor | None = None) -> torch.Tensor:
    """Row a of `send` goes to rank a of `group`; returns row b = what rank b sent here (on the device; into
    `out` where given)."""
    recv = torch.empty_like(send) if out is None else out
    timer.run(lambda: dist.all_to_all_single(recv, send.contiguous(), group=group), send.device)
    return recv


def block_transpose_index(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Rows laid out as blocks in (a, b) order, block (a, b) holding counts[a, b] rows, `total` rows in
    all; returns idx with rows[idx] laid out in (b, a) order, each block's rows kept in their order."""
    A, B = counts.shape   # blocks (a, b); the result reads them in (b, a) order ("_t")
    sizes_t = counts.t().reshape(-1)
    # A block's shift (where its rows come from less where they go) is the difference of its exclusive starts in
    # the two orders, i.e. of the inclusive ends, since the block's own size is in both.
    shift_t = counts.reshape(-1).cumsum(0).view(A, B).t().reshape(-1) - sizes_t.cumsum(0)
    return torch.arange(total, device=counts.device) + torch.repeat_interleave(shift_t, sizes_t,
                                                                                 output_size=total)


def regroup_index(counts: torch.Tensor, total: int) -> torch.Tensor | None:
    """block_transpose_index, or None where the (a, b) and (b, a) orders are the same for any counts: one row
    or one column of blocks (a shape the host knows, so nothing is read to decide)."""
    return None if 1 in counts.shape else block_transpose_index(counts, total)


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
    """How rows with given per-(destination rank, column) counts travel, planned once, used for every tensor
    that follows the same rows (token rows, their metadata, their gates)."""

    stages: list[_Stage]
    regroup: torch.Tensor | None        # arrival order -> (column, source rank) order
    recv_counts_PX: torch.Tensor        # rows that arrive from each source rank for each column (device)
    send_counts: list[list[int]] | None   # the same counts on the host: [destination rank][column]; None: not read
    recv_counts: list[list[int]] | None   # [source rank][column]; None: not read
    known_total: int | None = None      # rows sent (= arrived: nothing travels) where the counts were not read

    @property
    def num_sent(self) -> int:
        return self.known_total if self.send_counts is None else sum(map(sum, self.send_counts))

    @property
    def num_arrived(self) -> int:
        return self.known_total if self.recv_counts is None else sum(map(sum, self.recv_counts))


def _read_to_host(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The one device-to-host copy: every count tensor flattened, stacked and read at once."""
    flat = (tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])).tolist()
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.numel()])
        start += t.numel()
    return out


def _columns(host_flat: list[int], rows: int, width: int, first: int, last: int) -> list[list[int]]:
    return [host_flat[r * width + first:r * width + last] for r in range(rows)]


def _split_columns(counts: list[torch.Tensor]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c.shape[1]))
        start += c.shape[1]
    return bounds


class _Exchange:
    """move / move_back for any plan; subclasses plan the hops."""

    timer: CommTimer

    def move(self, rows: torch.Tensor, route: Route, regroup: bool = True) -> torch.Tensor:
        """Rows sorted by (destination rank, column) -> the rows that arrive here, column-major (`regroup=False`:
        as they arrive, by source rank, then column; `regroup` finishes them)."""
        for stage in route.stages:
            if stage.order_before_send is not None:
                rows = rows.index_select(0, stage.order_before_send)
            rows = all_to_all_rows(rows, stage.recv_splits, stage.send_splits, stage.group, self.timer)
        return self.regroup(rows, route) if regroup else rows

    @staticmethod
    def regroup(rows: torch.Tensor, route: Route) -> torch.Tensor:
        """Arrived rows (by source rank, then column) -> column-major."""
        return rows if route.regroup is None else rows.index_select(0, route.regroup)

    def start(self, rows: torch.Tensor, route: Route, regroup: bool = True) -> InFlight:
        """`move`, asynchronous: every hop but the last runs now, the last is in flight when this returns (the
        hierarchical exchange's inter-node hop, the one worth hiding); `land()` gives what `move` returns."""
        if not route.stages:
            return InFlight(rows, None, lambda rows: self.regroup(rows, route) if regroup else rows)
        *now, last = route.stages
        for stage in now:
            if stage.order_before_send is not None:
                rows = rows.index_select(0, stage.order_before_send)
            rows = all_to_all_rows(rows, stage.recv_splits, stage.send_splits, stage.group, self.timer)
        if last.order_before_send is not None:
            rows = rows.index_select(0, last.order_before_send)
        return start_all_to_all(rows, last.recv_splits, last.send_splits, last.group, self.timer,
                                lambda rows: self.regroup(rows, route) if regroup else rows)

    def start_back(self, rows: torch.Tensor, route: Route) -> InFlight:
        """`move_back`, asynchronous: its first hop (the inter-node one, hierarchically) is in flight when this
        returns; `land()` runs the rest and gives what `move_back` returns."""
        if route.regroup is not None:
            rows = _unpermute(rows, route.regroup)
        if not route.stages:
            return InFlight(rows, None, lambda rows: rows)
        first, *rest = reversed(route.stages)

        def then(rows: torch.Tensor) -> torch.Tensor:
            if first.order_before_send is not None:
                rows = _unpermute(rows, first.order_before_send)
            for stage in rest:
                rows = all_to_all_rows(rows, stage.send_splits, stage.recv_splits, stage.group, self.timer)
                if stage.order_before_send is not None:
                    rows = _unpermute(rows, stage.order_before_send)
            return rows
        return start_all_to_all(rows, first.send_splits, first.recv_splits, first.group, self.timer, then)

    def move_back(self, rows: torch.Tensor, route: Route) -> torch.Tensor:
        """The exact reverse of `move`."""
        if route.regroup is not None:
            rows = _unpermute(rows, route.regroup)
        for stage in reversed(route.stages):
            rows = all_to_all_rows(rows, stage.send_splits, stage.recv_splits, stage.group, self.timer)
            if stage.order_before_send is not None:
                rows = _unpermute(rows, stage.order_before_send)
        return rows


class LocalExchange(_Exchange):
    def __init__(self, timer: CommTimer | None = None, group=None):
        self.group, self.timer = group, timer or CommTimer()

    def plan(self, counts: list[torch.Tensor]) -> list[Route]:
        """One Route per [1, X_i] count tensor; reads them to the host in one copy (the dispatcher needs no plan
        where it knows the sizes: AllToAllDispatcher.dispatch_rows with every_token)."""
        host = _read_to_host(counts)
        return [Route([], None, c, [h], [h]) for c, h in zip(counts, host)]

    def plan_uniform(self, columns: int, per_block: int, device: torch.device) -> Route:
        """A Route for `per_block` rows per (rank, column), a size the host knows: nothing moves, nothing read."""
        return Route([], None, _full(1, columns, per_block, device), [[per_block] * columns],
                     [[per_block] * columns])


class FlatExchange(_Exchange):
    def __init__(self, group, timer: CommTimer | None = None):
        self.group, self.timer = group, timer or CommTimer()

    def plan(self, counts: list[torch.Tensor]) -> list[Route]:
        """One Route per [P, X_i] count tensor: one count exchange and one host read for all of them."""
        P, X = counts[0].shape[0], sum(c.shape[1] for c in counts)
        # Sent and received counts side by side in one buffer, so that one copy reads both to the host.
        both_2PX = counts[0].new_empty(2, P, X)
        send_PX = torch.cat(counts, dim=1, out=both_2PX[0])
        recv_PX = exchange_counts(send_PX, self.group, self.timer, out=both_2PX[1])
        (both_h,) = _read_to_host([both_2PX])
        send_h, recv_h = both_h[:P * X], both_h[P * X:]
        routes = []
        for first, last in _split_columns(counts):
            send, recv = _columns(send_h, P, X, first, last), _columns(recv_h, P, X, first, last)
            stage = _Stage(self.group, list(map(sum, send)), list(map(sum, recv)), None)
            recv_counts_PX = recv_PX[:, first:last]
            # Rows arrive as (source, column) blocks; regroup to (column, source).
            regroup = regroup_index(recv_counts_PX, sum(stage.recv_splits))
            routes.append(Route([stage], regroup, recv_counts_PX, send, recv))
        return routes

    def plan_uniform(self, columns: int, per_block: int, device: torch.device) -> Route:
        """A Route for `per_block` rows per (destination rank, column) from every rank, a size the host knows
        (capacity dispatch): no count exchange, no read; the regrouping is computed on the device."""
        P = dist.get_world_size(self.group)
        per_rank = [columns * per_block] * P
        counts_PX = _full(P, columns, per_block, device)
        host = [[per_block] * columns for _ in range(P)]
        return Route([_Stage(self.group, per_rank, per_rank, None)], regroup_index(counts_PX, sum(per_rank)),
                     counts_PX, host, host)


class HierarchicalExchange(_Exchange):
    """Two hops for P = Q nodes x W ranks per node (EP rank = node * W + local index)."""

    def __init__(self, group, intra_group, inter_group, ranks_per_node: int, num_nodes: int,
                 timer: CommTimer | None = None):
        self.group, self.intra_group, self.inter_group = group, intra_group, inter_group
        self.W, self.Q = ranks_per_node, num_nodes
        self.timer = timer or CommTimer()

    def plan(self, counts: list[torch.Tensor]) -> list[Route]:
        W, Q = self.W, self.Q
        send_PX = torch.cat(counts, dim=1)
        X = send_PX.shape[1]
        counts_QWX = send_PX.view(Q, W, X)
        # Hop 1, inside the node: to the rank whose local index is the destination's; order (s', q', x).
        send1_WQX = counts_QWX.transpose(0, 1).contiguous()
        recv1_WQX = exchange_counts(send1_WQX.view(W, Q * X), self.intra_group, self.timer).view(W, Q, X)
        # Hop 2, across nodes: arrived in (source s, q', x) order; regroup to (q', s, x) and send to node q'.
        send2_QWX = recv1_WQX.transpose(0, 1).contiguous()
        recv2_QWX = exchange_counts(send2_QWX.view(Q, W * X), self.inter_group, self.timer).view(Q, W, X)
        host = _read_to_host([send_PX, send1_WQX, recv1_WQX, send2_QWX, recv2_QWX])
        send_h, send1_h, recv1_h, send2_h, recv2_h = host
        routes = []
        for first, last in _split_columns(counts):
            def block(h, a, b):   # [a][b] sums over this stream's columns of an [a, b, X] host tensor
                return [[sum(h[(i * b + j) * X + first:(i * b + j) * X + last]) for j in range(b)] for i in range(a)]
            sent_QW, s1, r1 = block(send_h, Q, W), block(send1_h, W, Q), block(recv1_h, W, Q)
            s2, r2 = block(send2_h, Q, W), block(recv2_h, Q, W)
            cols = slice(first, last)
            order1 = regroup_index(_stream_QW(counts_QWX, first, last), sum(map(sum, sent_QW)))
            hop1 = _Stage(self.intra_group, list(map(sum, s1)), list(map(sum, r1)), order1)
            order2 = regroup_index(_stream_QW(recv1_WQX, first, last), sum(map(sum, r1)))
            hop2 = _Stage(self.inter_group, list(map(sum, s2)), list(map(sum, r2)), order2)
            # Arrived in (source node, source local index, x) = (source EP rank, x) order, exactly as a flat
            # exchange delivers: the same regrouping makes each column's rows contiguous.
            recv_counts_PX = recv2_QWX[:, :, cols].reshape(Q * W, last - first)
            regroup = regroup_index(recv_counts_PX, sum(map(sum, r2)))
            send = _columns(send_h, Q * W, X, first, last)
            recv = _columns(recv2_h, Q * W, X, first, last)
            routes.append(Route([hop1, hop2], regroup, recv_counts_PX, send, recv))
        return routes

    def plan_uniform(self, columns: int, per_block: int, device: torch.device) -> Route:
        """As FlatExchange.plan_uniform, over the two hops: every block of every hop has a size the host knows."""
        W, Q, block = self.W, self.Q, columns * per_block   # rows per (source, destination rank) pair
        order1 = regroup_index(_full(Q, W, block, device), Q * W * block)
        hop1 = _Stage(self.intra_group, [Q * block] * W, [Q * block] * W, order1)
        order2 = regroup_index(_full(W, Q, block, device), Q * W * block)
        hop2 = _Stage(self.inter_group, [W * block] * Q, [W * block] * Q, order2)
        counts_PX = _full(Q * W, columns, per_block, device)
        host = [[per_block] * columns for _ in range(Q * W)]
        return Route([hop1, hop2], regroup_index(counts_PX, Q * W * block), counts_PX, host, host)


def _full(rows: int, columns: int, value: int, device: torch.device) -> torch.Tensor:
    return torch.full((rows, columns), value, dtype=torch.long, device=device)


def _stream_QW(counts: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """One stream's rows per block: its columns first..last of a three-dimensional count tensor, summed."""
    return counts[:, :, first] if last - first == 1 else counts[:, :, first:last].sum(2)


def build_hierarchical_groups(ep_group, ranks_per_node: int) -> tuple[object, object, int, int]:
    """(intra_group, inter_group, W, Q) for this rank's expert-parallel group.

    Collective over the whole world: every rank creates every subgroup in the same order (torch requires it).
    An EP group of P ranks spans Q = P / W nodes; it must be made of whole nodes' worth of consecutive ranks.
    """
    ep_ranks = dist.get_process_group_ranks(ep_group)
    P, W = len(ep_ranks), min(ranks_per_node, len(ep_ranks))
    if P % W:
        raise ValueError(f"hierarchical all-to-all: {ranks_per_node} ranks per node do not divide the "
                         f"expert-parallel size {P}")
    all_ep_groups: list[list[int]] = [None] * dist.get_world_size()   # type: ignore[list-item]
    dist.all_gather_object(all_ep_groups, ep_ranks)
    intra = inter = None
    for ranks in sorted({tuple(g) for g in all_ep_groups}):
        for q in range(P // W):
            group = dist.new_group(list(ranks[q * W:(q + 1) * W]))
            if dist.get_rank() in ranks[q * W:(q + 1) * W]:
                intra = group
        for s in range(W):
            group = dist.new_group(list(ranks[s::W]))
            if dist.get_rank() in ranks[s::W]:
                inter = group
    return intra, inter, W, P // W
