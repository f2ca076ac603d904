"""What every routed expert layer shares: route the tokens, keep the routing's balance statistics, and record
the routing when asked (generation shows each word's experts).

Legend (docs/shapes.md): N tokens, D model dim, E global experts, C (token, expert) pairs.

MoELayer (FFN experts), HierarchicalMoELayer (two-level gate) and MoAAttention (attention experts) derive from
`RoutedLayer`; the flat ones call `route`, the hierarchical layer routes in two steps around the exchange and
calls `keep_stats` / `keep_routes` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moe_scale.moe.deepspeed_adapter import ExpertParallelModule
from moe_scale.moe.kernel_policy import count_per_bin
from moe_scale.moe.router import Router, RouterOutput

Routes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # (token_C, expert_C, gate_C) of this rank's tokens


@dataclass
class MoEStats:
    """Balance statistics of the last forward, over the whole data-parallel batch (detached)."""

    importance_E: torch.Tensor
    load_E: torch.Tensor
    metrics: dict[str, float | torch.Tensor]   # the router's own numbers (e.g. threshold agreement)
    routed_E: torch.Tensor | None = None      # hard counts per expert: this rank's tokens (hierarchical gate: the
                                              # pairs this rank's experts received); summed over ranks: the batch's


class RoutedLayer(ExpertParallelModule):
    """An expert-parallel layer with a router. Subclasses call `init_routed` first in their __init__."""

    def init_routed(self, num_experts: int, ep_size: int, ep_rank: int, router: Router) -> None:
        self.init_expert_parallel(num_experts, ep_size, ep_rank)
        self.router = router
        self.stats: MoEStats | None = None
        self.record_routes = False   # True: forward keeps its pairs in `routes` (one process)
        self.routes: Routes | None = None

    def route(self, x_ND: torch.Tensor) -> RouterOutput:
        """The router on x_ND, its statistics kept and (if asked) its pairs recorded."""
        route = self.router(x_ND)
        self.keep_routes(route.pairs)
        self.keep_stats(route.importance_E, route.load_E, route.metrics, count_per_bin(route.expert_C,
                                                                                       self.num_experts))
        return route

    def keep_stats(self, importance_E: torch.Tensor, load_E: torch.Tensor, metrics: dict,
                   routed_E: torch.Tensor) -> None:
        self.stats = MoEStats(importance_E.detach(), load_E.detach(), dict(metrics), routed_E)

    def keep_routes(self, routes: Callable[[], Routes]) -> None:
        """Keep `routes()` when recording (computed only then)."""
        if self.record_routes:
            self.routes = routes()
