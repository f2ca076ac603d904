"""What every routed expert layer shares: route the tokens, keep the routing's balance statistics, and record
the routing when asked (generation shows each word's experts).

Legend (docs/shapes.md): N tokens, D model dim, E global experts, C (token, expert) pairs.

MoELayer (FFN experts), HierarchicalMoELayer (two-level gate) and MoAAttention (attention experts) derive from
`RoutedLayer`; the flat ones call `route`, the hierarchical layer routes in two steps around the exchange and
calls `keep_stats` / `keep_routes` itself.

Padding rows (evaluation's last windows) are routed like any row, but the balance statistics reported
(metrics/balance.py) count the real tokens only: `real_tokens(layers, real_N)` marks them for the forwards of
a block, and `routed_balance` leaves the other rows' pairs out. A gate that takes the mask itself
(`Router.takes_valid_rows`: the batchwise gate, whose metrics count rows) gives padding no expert.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from moe_scale.moe.deepspeed_adapter import ExpertParallelModule
from moe_scale.moe.kernel_policy import count_per_bin
from moe_scale.moe.router import Router, RouterOutput

Routes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # (token_C, expert_C, gate_C) of this rank's tokens


@dataclass
class MoEStats:
    """Balance statistics of the last forward (detached). The router's own two are over the whole data-parallel
    batch, padding included: what its balancing loss saw. The routed ones count the real tokens' pairs only:
    this rank's tokens (hierarchical gate: the pairs this rank's experts received); summed over ranks: the
    batch's. Reports use the routed ones (metrics/balance.py)."""

    importance_E: torch.Tensor   # the router's: summed gates
    load_E: torch.Tensor         # the router's: smooth load with noise in training, else a count
    metrics: dict[str, float | torch.Tensor]   # the router's own numbers (e.g. threshold agreement)
    routed_E: torch.Tensor | None = None         # (token, expert) pairs per expert, real tokens only
    routed_gates_E: torch.Tensor | None = None   # the gates of those pairs, summed per expert


def routed_balance(expert_C: torch.Tensor, gate_C: torch.Tensor, weight_C: torch.Tensor | None,
                   num_experts: int, local_gates_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, summed gates) per expert [E], float32, of the pairs whose weight is 1 (`weight_C`: 1 for a real
    token's pair, 0 for a padding row's; None: every pair counts; then `local_gates_E`, the router's own sum of
    the same gates, if it made one, is the second). On the device, no host read."""
    gate_C = gate_C.detach().float()
    if weight_C is None:
        return count_per_bin(expert_C, num_experts, torch.float32), \
            gate_C.new_zeros(num_experts).index_add_(0, expert_C, gate_C) if local_gates_E is None \
            else local_gates_E.detach().float()
    weight_C = weight_C.float()
    return (gate_C.new_zeros(num_experts).index_add_(0, expert_C, weight_C),
            gate_C.new_zeros(num_experts).index_add_(0, expert_C, gate_C * weight_C))


@contextmanager
def real_tokens(layers: Iterable["RoutedLayer"], real_N: torch.Tensor | None) -> Iterator[None]:
    """Within the block the layers' balance statistics count only the rows where `real_N` (bool [N], the
    model's tokens in [B, T] order, flattened) is True; None: every row."""
    layers = list(layers)
    for layer in layers:
        layer.real_tokens_N = real_N
    try:
        yield
    finally:
        for layer in layers:
            layer.real_tokens_N = None


class RoutedLayer(ExpertParallelModule):
    """An expert-parallel layer with a router. Subclasses call `init_routed` first in their __init__."""

    def init_routed(self, num_experts: int, ep_size: int, ep_rank: int, router: Router,
                    tensor_parallel: int = 1) -> None:
        self.init_expert_parallel(num_experts, ep_size, ep_rank, tensor_parallel)
        self.router = router
        self.stats: MoEStats | None = None
        self.record_routes = False   # True: forward keeps its pairs in `routes` (one process)
        self.routes: Routes | None = None
        self.real_tokens_N: torch.Tensor | None = None   # see real_tokens(); None: every row is a real token
        self.force_balanced = False   # --force-balanced-routing: the router's pairs go to the experts round-robin
        self.route_tape = None   # moe/route_tape.py: records this layer's routing, or replays a record
        self.tape_index = 0

    def route(self, x_ND: torch.Tensor, seq_len: int | None = None) -> RouterOutput:
        """The router on x_ND (rows: sequences of `seq_len` tokens, for a gate that reads it), its statistics
        kept and (if asked) its pairs recorded."""
        real_N = self.real_rows(x_ND.shape[0])
        given = real_N is not None and self.router.takes_valid_rows   # the gate leaves padding out itself
        extra = {"valid_N": real_N} if given else {}
        if self.router.takes_seq_len:
            extra["seq_len"] = seq_len
        route = self.router(x_ND, **extra)
        if self.route_tape is not None:
            route = self.route_tape.apply(self, route)
        if self.force_balanced:
            route = route.round_robin(self.num_experts)
        self.keep_routes(route.pairs)
        weight_C = None if real_N is None else real_N.index_select(0, route.token_C)
        self.keep_stats(route.importance_E, route.load_E, route.metrics,
                        *routed_balance(route.expert_C, route.gate_C, weight_C, self.num_experts,
                                        route.local_gates_E))
        return route

    def real_rows(self, num_rows: int) -> torch.Tensor | None:
        """The real-token mask of this forward's `num_rows` rows (None: all real)."""
        real_N = self.real_tokens_N
        if real_N is not None and real_N.shape != (num_rows,):
            raise ValueError(f"real_tokens: a mask of {tuple(real_N.shape)} for {num_rows} rows")
        return real_N

    def keep_stats(self, importance_E: torch.Tensor, load_E: torch.Tensor, metrics: dict,
                   routed_E: torch.Tensor, routed_gates_E: torch.Tensor) -> None:
        self.stats = MoEStats(importance_E.detach(), load_E.detach(), dict(metrics), routed_E, routed_gates_E)

    def keep_routes(self, routes: Callable[[], Routes]) -> None:
        """Keep `routes()` when recording (computed only then)."""
        if self.record_routes:
            self.routes = routes()
