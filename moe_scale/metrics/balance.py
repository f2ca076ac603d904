"""Expert-balance statistics reported per MoE layer (Shazeer et al. Table 6).

Legend (docs/shapes.md): E experts.

CV is the coefficient of variation itself (not CV^2), population variance; importance and load are the
global-batch vectors the router computed (load: smooth estimator in training, hard count at eval).

They are reported over all tokens of a logging interval (or of an evaluation pass), not per batch: with
many experts a small batch gives each expert a handful of tokens, and the sampling noise alone would put
the CV near 1/sqrt(tokens per expert) however well balanced the router is. The paper's batches held
~300k words; summing the vectors over an interval measures the router, not the batch size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_scale.distributed.comm import collective_device
from moe_scale.moe.losses import cv_squared


def balance_metrics(importance_E: torch.Tensor, load_E: torch.Tensor) -> dict[str, float]:
    load = load_E.double()
    return {
        "cv_importance": float(cv_squared(importance_E.double()).sqrt()),
        "cv_load": float(cv_squared(load).sqrt()),
        "max_over_mean_load": float(load.max() / (load.mean() + 1e-10)),
    }


class MeanTracker:
    """Running means of named scalars over a logging interval."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.count += 1

    def means(self) -> dict[str, float]:
        return {name: total / max(self.count, 1) for name, total in self.sums.items()}

    def reset(self) -> None:
        self.sums, self.count = {}, 0


class MoEMetrics:
    """Per MoE layer: importance and load summed over the forwards seen since the last reset, and the
    router's own metrics averaged over them. Keys are prefixed with `layer<i>_` when there are several
    MoE layers. The sums stay on the layers' device between log points; `values()` reads them."""

    def __init__(self, layers):
        self.layers = list(layers)
        self.reset()

    def reset(self) -> None:
        self.importance: list[torch.Tensor | None] = [None] * len(self.layers)
        self.load: list[torch.Tensor | None] = [None] * len(self.layers)
        self.routed: list[torch.Tensor | None] = [None] * len(self.layers)
        self.router_sums: dict[str, torch.Tensor | float] = {}
        self.count = 0

    def add(self) -> None:
        """Record the last forward of every layer (device additions only)."""
        for index, layer in enumerate(self.layers):
            stats = layer.stats
            importance, load = stats.importance_E.detach().double(), stats.load_E.detach().double()
            self.importance[index] = importance if self.importance[index] is None else \
                self.importance[index] + importance
            self.load[index] = load if self.load[index] is None else self.load[index] + load
            if stats.routed_E is not None:
                routed = stats.routed_E.detach().double()
                self.routed[index] = routed if self.routed[index] is None else self.routed[index] + routed
            for name, value in stats.metrics.items():
                key = self._prefix(index) + name
                value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
                self.router_sums[key] = self.router_sums.get(key, 0.0) + value
        self.count += 1

    def values(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for index in range(len(self.layers)):
            if self.importance[index] is not None:
                balance = balance_metrics(self.importance[index], self.load[index])
                out.update({self._prefix(index) + name: value for name, value in balance.items()})
        out.update({name: float(total) / max(self.count, 1) for name, total in self.router_sums.items()})
        return out

    def relative_loads(self) -> list[torch.Tensor]:
        """Per layer that routed since the last reset: the tokens each expert received over the mean [E] (1 =
        even), summed over every rank (one all-reduce of all layers' counts; call it on every rank)."""
        routed = [r for r in self.routed if r is not None]
        if not routed:
            return []
        flat = torch.cat(routed)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flat = flat.to(collective_device())
            dist.all_reduce(flat)
        return [(r / r.mean().clamp_min(1e-12)).float().cpu() for r in flat.split([len(r) for r in routed])]

    def _prefix(self, index: int) -> str:
        return "" if len(self.layers) == 1 else f"layer{index}_"
