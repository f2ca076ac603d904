"""The memory model by hand on a small LSTM-MoE, the dispatch bound of each mode, and the margin's boundary."""

from __future__ import annotations

import dataclasses

import pytest

from moe_scale.accounting.gpus import get_gpu
from moe_scale.accounting.layout import Layout
from moe_scale.accounting.memory import GIB, communicators, memory
from moe_scale.accounting.model_shape import planned_model
from moe_scale.config import RunConfig

TABLES = 500 * 32 + 500 * 32 + 500                               # the embedding and the softmax (weight, bias)
DENSE = 2 * (4 * 32 * 64 + 2 * 4 * 32) + 2 * 32 * 8              # the LSTMs and the gates
EXPERTS = 8 * 2 * 32 * 48
TOKENS = 512


def small(**settings) -> RunConfig:
    config = RunConfig.from_settings(vocab_size=500, d_model=32, expert_hidden=48, num_experts=8, top_k=2, **settings)
    config.validate()
    return config


def test_every_part_by_hand():
    model = planned_model(small())
    assert (model.dense_params, model.sharded_params, model.vocab_params) == (DENSE, EXPERTS, TABLES)
    layout = Layout(1, 4, ep_size=4, zero_stage=2)
    result = memory(model, layout, get_gpu("h100-sxm"), TOKENS, {"zero_optimization": {"stage": 2}})
    b = result["bytes"]
    local = EXPERTS // 4 + TABLES / 4     # each rank's experts and rows of the tables (--vocab-exchange rows)
    assert model.params_per_gpu(4, 4) == DENSE + local
    assert b["parameters"] == (DENSE + local) * 4
    assert b["gradients"] == DENSE * 4 / 4 + local * 4            # dense over 4 ranks; each expert on one rank
    assert b["optimizer_state"] == DENSE * 8 / 4 + local * 8
    per_gpu = TOKENS / 4
    assert b["activations"] == per_gpu * ((32 + 2 * 7 * 32 + 16 + 32 + 500 + 3 * 32) * 4 + 4 * 32)
    rows = per_gpu * 4 * (1 - 15 / 28)          # distinct ranks of 2 experts out of 8 on 4 ranks: 13/7 per token
    pairs = 2.0 * per_gpu * 2                   # dropless at 2x the balanced load, k = 2
    stored = pairs * ((48 + 32) * 4 + 4 + 8) + 2.0 * rows * 32 * 4
    transient = 2 * rows * 32 * 4               # the send and the returned message of one layer
    assert b["dispatch_buffers"] == pytest.approx(stored + transient)
    assert b["cuda_context"] == 0.5 * GIB
    assert b["nccl_buffers"] == pytest.approx(2 * (0.6 + 0.3) * GIB)    # data- and expert-parallel; NVLS on H100
    assert b["deepspeed_buckets"] == 4 * 2 * (DENSE + local)            # buckets no larger than what they hold
    assert b["fragmentation"] == pytest.approx(0.05 * (b["activations"] + b["dispatch_buffers"]))
    assert b["total"] == pytest.approx(sum(v for k, v in b.items() if k != "total"))


def test_tables_kept_whole_are_dense_state():
    model = planned_model(small(vocab_exchange="dense"))
    layout = Layout(1, 4, ep_size=4, zero_stage=2)
    b = memory(model, layout, get_gpu("h100-sxm"), TOKENS, {"zero_optimization": {"stage": 2}})["bytes"]
    assert b["parameters"] == (DENSE + TABLES + EXPERTS // 4) * 4
    assert b["optimizer_state"] == (DENSE + TABLES) * 8 / 4 + EXPERTS // 4 * 8
    assert planned_model(small()).params_per_gpu(1, 1) == DENSE + TABLES + EXPERTS     # one rank holds everything


def test_factored_state():
    model = planned_model(small(optimizer="factored"))
    layout = Layout(1, 2, ep_size=2, optimizer="factored")
    b = memory(model, layout, get_gpu("a100-80"), TOKENS, {})["bytes"]
    # 4 experts here: w_in, w_out rows + columns; half the tables' rows with Adam's state
    assert b["optimizer_state"] == DENSE * 8 + 4 * 2 * (48 + 32) * 4 + TABLES / 2 * 8
    assert communicators(layout, model) == 2


def test_recompute_stores_no_hidden_layer_and_recomputes_one_layer_at_a_time():
    model = planned_model(small(model="transformer", ffn="moe", num_layers=3))
    layout = Layout(1, 2, ep_size=2)
    kept = memory(model, layout, get_gpu("a100-80"), TOKENS, {})["bytes"]["dispatch_buffers"]
    recomputed = memory(model, dataclasses.replace(layout, recompute=True), get_gpu("a100-80"), TOKENS,
                        {})["bytes"]["dispatch_buffers"]
    pairs = 2.0 * TOKENS / 2 * 2            # 2x the balanced load of 256 tokens x k = 2, per layer
    assert kept - recomputed == pytest.approx((3 - 1) * pairs * 48 * 4)


def test_capacity_dispatch_is_bounded_by_its_factor_and_dropless_by_the_stated_load():
    layout = Layout(1, 8, ep_size=8)
    dropless = memory(planned_model(small()), layout, get_gpu("h100-sxm"), TOKENS, {}, dropless_load=3.0)
    capacity = memory(planned_model(small(dispatch="capacity", capacity_factor=1.25)), layout, get_gpu("h100-sxm"),
                      TOKENS, {})
    assert (dropless["dispatch_load"], capacity["dispatch_load"]) == (3.0, 1.25)
    assert dropless["all_to_one_bytes"] > dropless["bytes"]["dispatch_buffers"] > capacity["bytes"]["dispatch_buffers"]


def test_fits_only_with_the_margin():
    model, layout = planned_model(small()), Layout(1, 4, ep_size=4)
    total = memory(model, layout, get_gpu("h100-sxm"), TOKENS, {})["bytes"]["total"]
    for margin in (0.0, 0.05, 0.2):
        exact = get_gpu("h100-sxm").with_memory(total / GIB / (1 - margin))
        assert memory(model, layout, exact, TOKENS, {}, margin=margin)["fits"]
        short = get_gpu("h100-sxm").with_memory(total / GIB / (1 - margin) * (1 - 1e-9))
        assert not memory(model, layout, short, TOKENS, {}, margin=margin)["fits"]
