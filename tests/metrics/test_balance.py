"""Balance statistics over an interval: summed vectors, not averaged per-batch CVs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_scale.metrics.balance import MoEMetrics, balance_metrics
from moe_scale.moe.routed_layer import MoEStats


def fake_layer():
    return SimpleNamespace(stats=None)


def test_cv_is_taken_over_the_summed_interval():
    layer = fake_layer()
    metrics = MoEMetrics([layer])
    # two batches, each all on one expert, but on different experts: balanced over the interval
    for hot in (0, 1):
        vector = torch.zeros(2)
        vector[hot] = 4.0
        layer.stats = MoEStats(vector, vector, {"agreement": float(hot)}, routed_E=vector)
        metrics.add()
    values = metrics.values()
    assert values["cv_importance"] == pytest.approx(0.0, abs=1e-9)
    assert values["max_over_mean_load"] == pytest.approx(1.0)
    assert values["agreement"] == pytest.approx(0.5)            # router metrics are means over batches
    assert metrics.relative_loads()[0].tolist() == [1.0, 1.0]  # tokens routed, summed over the interval
    metrics.reset()
    assert metrics.values() == {}


def test_balance_metrics_by_hand_and_layer_prefixes():
    values = balance_metrics(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 0.0, 6.0]))
    assert values["cv_importance"] == pytest.approx(0.5)              # std 1 / mean 2, population variance
    assert values["cv_load"] == pytest.approx(2 ** 0.5)               # one-hot of length 3: sqrt(n - 1)
    assert values["max_over_mean_load"] == pytest.approx(3.0)
    first, second = fake_layer(), fake_layer()
    for layer in (first, second):
        layer.stats = MoEStats(torch.ones(2), torch.ones(2), {})
    metrics = MoEMetrics([first, second])
    metrics.add()
    assert {"layer0_cv_load", "layer1_cv_load"} <= set(metrics.values())
