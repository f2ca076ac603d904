"""Expert-balance statistics reported per MoE layer (Shazeer et al. Table 6).

CV is the coefficient of variation itself (not CV^2), population variance; importance and load are the
global-batch vectors the router computed (load: smooth estimator in training, hard count at eval).
"""

from __future__ import annotations

import torch

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


def moe_metrics(layers) -> dict[str, float]:
    """Balance statistics and router metrics of every MoE layer's last forward; keys are prefixed with
    `layer<i>_` when the model has more than one MoE layer."""
    out: dict[str, float] = {}
    for index, layer in enumerate(layers):
        prefix = "" if len(layers) == 1 else f"layer{index}_"
        values = {**balance_metrics(layer.stats.importance_E, layer.stats.load_E), **layer.stats.metrics}
        out.update({prefix + name: float(value) for name, value in values.items()})
    return out
