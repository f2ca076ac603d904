"""What the planner says the split vocabulary tables move (accounting/vocab_exchange.py): the expected distinct
words against drawing them, each softmax's moves by hand, and their seconds on the network model."""

from __future__ import annotations

import pytest
import torch

from moe_scale.accounting.layout import Layout
from moe_scale.accounting.model_shape import planned_model
from moe_scale.accounting.step_time import Network, step_time, vocab_exchange_seconds
from moe_scale.accounting.vocab_exchange import expected_distinct, exchanges
from moe_scale.config import RunConfig
from tests.accounting.test_step_time import GPU, INTRA


def _config(**settings) -> RunConfig:
    config = RunConfig.from_settings(vocab_size=500, d_model=32, expert_hidden=48, num_experts=8, top_k=2,
                                     **settings)
    config.validate()
    return config


def test_expected_distinct_words_equal_drawing_them():
    V, n, trials = 200, 150, 4000
    p = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial((p / p.sum()).expand(trials, V), n, replacement=True, generator=g)
    drawn = torch.tensor([row.unique().numel() for row in draws], dtype=torch.float64)
    assert expected_distinct(V, n) == pytest.approx(drawn.mean().item(), rel=3 * drawn.std().item() / trials ** 0.5
                                                    / drawn.mean().item())
    assert expected_distinct(V, 1) == pytest.approx(1.0)
    assert expected_distinct(V, 0) == 0.0 and expected_distinct(V, 1e9) == pytest.approx(V)


def test_each_softmax_moves_by_hand():
    n, d, P = 64.0, 32, 4
    u, u_s = expected_distinct(500, n), expected_distinct(500, n + 16)
    fetch = lambda ids, width: [("all_to_all", P * 8), ("all_to_all", ids * 8), ("all_to_all", ids * width * 4),  # noqa
                                ("all_to_all", ids * width * 4)]
    sampled = _config(softmax="sampled", num_sampled=16)
    assert exchanges(sampled, 500, P, n, 4) == fetch(u, d) + fetch(u_s, d + 1)          # rows and their biases
    full = exchanges(_config(), 500, P, n, 4)
    M = P * n
    assert full[:4] == fetch(u, d)
    assert full[4:] == [("all_reduce", P * 8), ("all_gather", M * d * 4), ("all_gather", M * 8)] + \
        [("all_reduce", M * 4)] * 4 + [("all_reduce", M * d * 4)]
    adaptive = exchanges(_config(softmax="adaptive", adaptive_cutoffs="100,300"), 500, P, n, 4)
    assert adaptive[:4] == fetch(u, d)
    harmonic = sum(1 / v for v in range(1, 501))
    for tail, (low, high, width) in enumerate([(100, 300, 8), (300, 500, 2)]):   # widths d/4, d/16
        m = M * sum(1 / v for v in range(low + 1, high + 1)) / harmonic   # the tail's share of the tokens
        moves = adaptive[4 + 8 * tail: 12 + 8 * tail]
        assert [kind for kind, _ in moves] == [kind for kind, _ in full[4:]]
        assert [b for _, b in moves] == pytest.approx([P * 8, m * width * 4, m * 8] + [m * 4] * 4 + [m * width * 4])
    assert len(adaptive) == 20
    assert exchanges(_config(vocab_exchange="dense"), 500, P, n, 4) == []
    assert exchanges(sampled, 500, 1, n, 4) == []          # one expert-parallel rank: nothing is split


def test_seconds_on_the_network_and_in_the_step():
    model, layout, net = planned_model(_config(softmax="sampled", num_sampled=16)), Layout(1, 4, ep_size=4), \
        Network(GPU, 4)
    expected = sum(net.all_to_all(nbytes, 4, 4) for _, nbytes in exchanges(model.config, 500, 4, 256.0, 4))
    assert vocab_exchange_seconds(net, model, layout, 256.0, 4) == pytest.approx(expected)
    assert expected > 8 * 1e-5 and expected < 8 * 1e-5 + 4 * 256 * 33 * 4 / INTRA   # latency-bound at this size
    assert step_time(model, layout, GPU, 1024, {})["seconds"]["vocab_exchange"] == pytest.approx(expected)
