"""Balance statistics over an interval: summed vectors, not averaged per-batch CVs, of the real tokens only."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from moe_scale.config import HierarchicalConfig, MoEConfig, RouterConfig
from moe_scale.metrics.balance import MoEMetrics, balance_metrics
from moe_scale.moe.build import build_moe_layer
from moe_scale.moe.routed_layer import MoEStats, real_tokens


def fake_layer():
    return SimpleNamespace(stats=None, ep_size=1, expert_parallel_size=1)


def test_cv_is_taken_over_the_summed_interval():
    layer = fake_layer()
    metrics = MoEMetrics([layer])
    # two batches, each all on one expert, but on different experts: balanced over the interval
    for hot in (0, 1):
        vector = torch.zeros(2)
        vector[hot] = 4.0
        layer.stats = MoEStats(vector, vector, {"agreement": float(hot)}, routed_E=vector, routed_gates_E=vector)
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
        layer.stats = MoEStats(torch.ones(2), torch.ones(2), {}, torch.ones(2), torch.ones(2))
    metrics = MoEMetrics([first, second])
    metrics.add()
    assert {"layer0_cv_load", "layer1_cv_load"} <= set(metrics.values())


def test_the_interval_sums_every_layers_vectors_exactly_whichever_layers_route():
    """add() sums all layers' vectors in one float64 tensor; a step where a layer did not route (its stats carry no
    routed vectors) changes which slices there are, and the sums stay those of each layer's own forwards."""
    first, second = fake_layer(), fake_layer()
    metrics = MoEMetrics([first, second], router_load=True)
    steps = [(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.5, 1.0])), (torch.tensor([4.0, 0.0]), None),
             (torch.tensor([0.25, 8.0]), torch.tensor([1.0, 1.0, 2.0])), (torch.tensor([1.0, 1.0]), torch.tensor(
                 [0.0, 0.0, 7.0]))]
    for a, b in steps:
        first.stats = MoEStats(a * 3, a * 5, {}, routed_E=a, routed_gates_E=a * 2)
        second.stats = MoEStats(torch.ones(3), torch.ones(3) * 9, {}, routed_E=b, routed_gates_E=None if b is None
                                else b * 7)
        metrics.add()
    assert metrics.routed[0].tolist() == [6.25, 11.0] and metrics.gates[0].tolist() == [12.5, 22.0]
    assert metrics.load[0].tolist() == [31.25, 55.0] and metrics.load[1].tolist() == [36.0] * 3
    assert metrics.routed[1].tolist() == [4.0, 1.5, 10.0] and metrics.gates[1].tolist() == [28.0, 10.5, 70.0]
    assert all(t.dtype == torch.float64 for t in metrics.routed + metrics.gates + metrics.load)


GATES = {
    "noisy_topk": RouterConfig(gate="noisy_topk", top_k=2),
    "hierarchical": RouterConfig(gate="hierarchical", top_k=2,
                                 hierarchical=HierarchicalConfig(num_groups=4, top_k_secondary=1)),
    "batchwise": RouterConfig(gate="batchwise", top_k=2),
    "softmax_topk": RouterConfig(gate="softmax_topk", top_k=3),
}


@pytest.mark.parametrize("gate", sorted(GATES))
def test_padding_rows_leave_the_balance_as_the_real_tokens_alone_give_it(gate):
    """Padding rows are routed like any row (here to one expert mostly, as evaluation's repeated </S> inputs
    are), but with real_tokens() marking them the layer's routed statistics, and the interval's balance, equal
    those of the real rows alone; without the mark they do not (the test can fail)."""
    d = 16
    torch.manual_seed(0)
    layer = build_moe_layer(replace(MoEConfig(), router=GATES[gate]), d).eval()
    with torch.no_grad():
        for p in layer.router.parameters():
            p.copy_(torch.randn(p.shape))
    x = torch.randn(24, d)
    real = torch.ones(40, dtype=torch.bool)
    real[torch.randperm(40, generator=torch.Generator().manual_seed(1))[:16]] = False   # padding between tokens
    padded = torch.empty(40, d)
    padded[real], padded[~real] = x, torch.randn(d) * 3

    def balance(rows, real_N):
        metrics = MoEMetrics([layer])
        with torch.no_grad(), real_tokens([layer], real_N):
            layer(rows)
        metrics.add()
        return layer.stats, metrics.values()

    alone, alone_values = balance(x, None)
    marked, marked_values = balance(padded, real)
    torch.testing.assert_close(marked.routed_E, alone.routed_E, rtol=0, atol=0)
    torch.testing.assert_close(marked.routed_gates_E, alone.routed_gates_E)
    with torch.no_grad():
        assert alone.routed_E.sum() == len(layer.router(x).expert_C)             # every pair of a real token
        assert len(layer.router(padded).expert_C) > alone.routed_E.sum()
    assert marked_values == pytest.approx(alone_values, rel=1e-6)
    unmarked, unmarked_values = balance(padded, None)
    assert unmarked.routed_E.sum() > alone.routed_E.sum()
    assert unmarked_values["cv_load"] != pytest.approx(alone_values["cv_load"], rel=1e-3)
    with pytest.raises(ValueError, match="a mask of \\(24,\\) for 40 rows"):
        balance(padded, real[:24])


@pytest.mark.parametrize("gate", ["noisy_topk", "hierarchical"])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25])
def test_capacity_mode_padding_takes_no_capacity(capacity_factor, gate):
    """Evaluation's padding rows (marked by real_tokens()) neither take an expert's capacity nor enlarge it: the
    real tokens' outputs equal those of an unpadded batch of them (without the mark they do not)."""
    d = 16
    torch.manual_seed(0)
    config = replace(MoEConfig(), router=GATES[gate])
    config = replace(config, dispatch=replace(config.dispatch, mode="capacity", capacity_factor=capacity_factor))
    layer = build_moe_layer(config, d).eval()
    with torch.no_grad():
        for p in layer.router.parameters():
            p.copy_(torch.randn(p.shape))
    x = torch.randn(24, d)
    real = torch.ones(40, dtype=torch.bool)
    real[torch.randperm(40, generator=torch.Generator().manual_seed(1))[:16]] = False
    padded = torch.empty(40, d)
    padded[real], padded[~real] = x, torch.randn(d) * 3          # padding mostly routed alike, as </S> inputs are
    with torch.no_grad():
        alone, _ = layer(x)
        with real_tokens([layer], real):
            marked, _ = layer(padded)
        unmarked, _ = layer(padded)
    torch.testing.assert_close(marked[real], alone, rtol=1e-6, atol=1e-6)
    assert (marked[~real] == 0).all()                              # padding reaches no expert
    assert not torch.allclose(unmarked[real], alone, rtol=1e-4, atol=1e-4)
    with torch.no_grad(), real_tokens([layer], real):              # the balance: the real tokens' pairs alone
        layer(padded)
    marked_stats = layer.stats
    with torch.no_grad():
        layer(x)
    torch.testing.assert_close(marked_stats.routed_E, layer.stats.routed_E, rtol=0, atol=0)
