"""The planner on the paper's configurations and on custom models: train's checks shared, the smallest cluster that
fits, the default expert-parallel size, and the layout search's ranking."""

from __future__ import annotations

import dataclasses

import pytest

from moe_scale.accounting.gpus import get_gpu
from moe_scale.accounting.layout import Layout, checked_config
from moe_scale.accounting.layout_search import candidate_layouts, search
from moe_scale.accounting.model_shape import planned_model, sharded
from moe_scale.accounting.plan import Planner
from moe_scale.accounting.presets import get_preset, preset_config
from moe_scale.config import RunConfig
from moe_scale.errors import UserError
from moe_scale.layout.ds_config import DEFAULT_DS_CONFIG
from moe_scale.layout.checks import check_optimizer_fits


def paper_planner(name: str, vocab_exchange: str = "rows") -> Planner:
    preset, config = get_preset(name), preset_config(name)
    config.softmax.kind, config.softmax.num_sampled = preset.softmax.kind, preset.softmax.num_samples
    config.parallel.vocab_exchange = vocab_exchange
    return Planner(planned_model(config), get_gpu("k40"), DEFAULT_DS_CONFIG, preset.batch_words, name=name)


def k40s(nodes: int, optimizer: str = "factored", zero: int = 0, ep: int = 1) -> Layout:
    return Layout(nodes, 4, ep_size=ep, zero_stage=zero, optimizer=optimizer, recompute=True)


def test_the_largest_100b_models_on_k40s_with_the_factored_optimizer_at_zero_0():
    """The factored optimizer trains at ZeRO-0 only (train refuses it under ZeRO-1/2), so every GPU keeps the dense
    parameters' Adam state whole; with the runtime's reserves and the 5% margin MoE-131072-h needs 256 K40s (the
    paper trained it on 128) and MoE-65536-h 128 (the paper: 64). With Adam, MoE-131072-h fits on 1,792 K40s (ep
    256) only because the vocabulary tables' rows and their Adam state are split over the expert-parallel ranks;
    kept whole on every GPU (--vocab-exchange dense) it fits nowhere."""
    largest, second = paper_planner("news100b-moe-131072-h"), paper_planner("news100b-moe-65536-h")
    assert largest.smallest_fitting(k40s(1), ep_fixed=False)["world"] == 256
    assert not largest.plan(k40s(32, ep=128))["fits"]
    assert second.smallest_fitting(k40s(1), ep_fixed=False)["world"] == 128
    assert largest.smallest_fitting(k40s(1, "adam"), ep_fixed=False)["world"] == 1792
    whole = paper_planner("news100b-moe-131072-h", vocab_exchange="dense")
    assert whole.smallest_fitting(k40s(1, "adam"), ep_fixed=False) is None


def test_hierarchical_secondary_gates_are_counted_with_the_experts():
    planner = paper_planner("news100b-moe-65536-h")
    one, many = planner.plan(k40s(16, ep=64)), planner.plan(k40s(32, ep=128))
    sharded = 65536 * 2 * 512 * 1024 + 256 * 2 * 512 * 256          # experts, and the a·2·d·b secondary gates
    tables = planner.model.vocab_params                              # split by rows over the same ranks
    dense = one["params_per_gpu"] - sharded // 64 - round(tables / 64)
    assert many["params_per_gpu"] == dense + sharded // 128 + round(tables / 128)
    assert dense == planner.model.dense_params


def test_default_expert_parallel_size_divides_the_gpus_and_the_units():
    planner = paper_planner("lm1b-moe-256-h")        # 16 groups of 16 experts
    assert [planner.default_ep(world) for world in (8, 16, 24, 32, 48)] == [8, 16, 8, 16, 16]


@pytest.mark.parametrize("ds,layout", [
    ({"zero_optimization": {"stage": 2}}, Layout(1, 8, ep_size=8, zero_stage=2, optimizer="factored")),
    ({"zero_optimization": {"stage": 1}}, Layout(1, 8, ep_size=8, zero_stage=1, optimizer="factored")),
    ({"bf16": {"enabled": True}}, Layout(1, 8, ep_size=8, optimizer="factored", precision="bf16")),
])
def test_a_layout_train_refuses_is_refused_with_trains_message(ds, layout):
    config = RunConfig.from_settings(num_experts=8, optimizer="factored")
    with pytest.raises(UserError) as train_says:
        check_optimizer_fits(config.train, ds, "X")
    planner = Planner(planned_model(config), get_gpu("h100-sxm"), DEFAULT_DS_CONFIG)
    with pytest.raises(UserError) as plan_says:
        planner.plan(layout)
    assert str(plan_says.value).split(" has ", 1)[1] == str(train_says.value).split(" has ", 1)[1]


def test_the_search_ranks_only_what_train_accepts_and_fits_fastest_first():
    config = RunConfig.from_settings(num_experts=16, d_model=64, expert_hidden=256, vocab_size=2000, batch_size=64)
    config.validate()
    small = dataclasses.replace(get_gpu("a100-40"), memory_gib=12 / 1024, cuda=False)   # 12 MiB, no reserves
    planner = Planner(planned_model(config), small, DEFAULT_DS_CONFIG)
    base = Layout(1, 4)
    found = search(planner, base, [1, 2, 4])
    ranked = found["ranked"]
    assert ranked and found["too_large"] > 0 and found["refused"]
    assert [r["tokens_per_s"] for r in ranked] == sorted((r["tokens_per_s"] for r in ranked), reverse=True)
    for r in ranked:      # train accepts every ranked layout, and it fits
        layout = Layout(r["nodes"], 4, r["ep_size"], r["zero_stage"], r["optimizer"], r["precision"], r["recompute"],
                        r["all_to_all"], r["etp_size"])
        checked_config(config, DEFAULT_DS_CONFIG, layout, None)
        assert r["fits"] and r["bytes"]["total"] <= r["usable_bytes"]
        assert not (r["optimizer"] == "factored" and r["zero_stage"] > 0)
    # the first is the fastest of every accepted, fitting layout, each planned on its own
    best = 0.0
    for layout in candidate_layouts(planner, base, [1, 2, 4]):
        try:
            result = planner.plan(layout)
        except UserError:
            continue
        best = max(best, result["tokens_per_s"] if result["fits"] else 0.0)
    assert ranked[0]["tokens_per_s"] == best
    assert found["considered"] == len(ranked) + found["too_large"] + sum(found["refused"].values())


def test_the_search_keeps_axes_a_dense_model_does_not_have():
    config = RunConfig.from_settings(layout="4xlstm", vocab_size=2000)
    planner = Planner(planned_model(config), get_gpu("h100-sxm"), DEFAULT_DS_CONFIG)
    layouts = candidate_layouts(planner, Layout(1, 8), [1, 2])
    assert {(x.ep_size, x.optimizer, x.recompute, x.all_to_all) for x in layouts} == {(1, "adam", False, "flat")}
    assert {(x.nodes, x.zero_stage) for x in layouts} == {(n, z) for n in (1, 2) for z in (0, 1, 2)}


def test_expert_tensor_parallelism_splits_the_experts_and_multiplies_the_rows():
    """--etp-size 2 at ep 4 on 8 GPUs: the experts' parameters over 8 ranks, not 4; each token's row goes to both
    shards of each expert rank it picks (2 x 4 (1 - C(6, 2) / C(8, 2)) ranks); the search tries etp 1, 2, 4, 8 (each
    dividing the hidden units), for the hierarchical gate too, whose secondary gates each shard's rank holds whole
    (their gradients summed over the shards: a small sync more)."""
    config = RunConfig.from_settings(num_experts=8, d_model=64, expert_hidden=256, vocab_size=2000, batch_size=64)
    config.validate()
    model = planned_model(config)
    planner = Planner(model, get_gpu("h100-sxm"), DEFAULT_DS_CONFIG)
    whole, split = planner.plan(Layout(1, 8, ep_size=4)), planner.plan(Layout(1, 8, ep_size=4, etp_size=2))
    assert whole["params_per_gpu"] - split["params_per_gpu"] == pytest.approx(model.sharded_params / 8, abs=1)
    assert split["etp_size"] == 2 and split["bytes"]["parameters"] < whole["bytes"]["parameters"]
    layer = sharded(model.expert_layers, 2)[0]
    assert layer.distinct_ranks(8) == pytest.approx(2 * 4 * (1 - 15 / 28))
    assert split["time"]["seconds"]["all_to_all"] > whole["time"]["seconds"]["all_to_all"]
    assert {x.etp_size for x in candidate_layouts(planner, Layout(1, 8), [1])} == {1, 2, 4, 8}
    given = RunConfig.from_settings(num_experts=8, d_model=64, expert_hidden=256, vocab_size=2000, batch_size=64,
                                    etp_size=2)   # `plan --etp-size 2`: the same model, the layout's shards
    assert planned_model(given).sharded_params == model.sharded_params
    hierarchical = RunConfig.from_settings(gate="hierarchical", num_groups=2, num_experts=8, expert_hidden=256,
                                           vocab_size=2000)
    two_level = Planner(planned_model(hierarchical), get_gpu("h100-sxm"), DEFAULT_DS_CONFIG)
    assert {x.etp_size for x in candidate_layouts(two_level, Layout(1, 8), [1])} == {1, 2, 4, 8}
    whole, split = two_level.plan(Layout(1, 8, ep_size=2)), two_level.plan(Layout(1, 8, ep_size=2, etp_size=2))
    copied = two_level.model.copied_params
    assert copied == 2 * 8 * hierarchical.model.d_model   # [groups, D, experts per group], twice
    assert whole["params_per_gpu"] - split["params_per_gpu"] == \
        pytest.approx((two_level.model.sharded_params - copied) / 4, abs=1)
    assert split["time"]["seconds"]["sync"] > whole["time"]["seconds"]["sync"]


def test_grad_accum_splits_activations_and_multiplies_the_exchanges():
    config = RunConfig.from_settings(num_experts=8, vocab_size=2000, batch_size=64)
    accumulated = planned_model(config)
    config4 = RunConfig.from_settings(num_experts=8, vocab_size=2000, batch_size=64, grad_accum=4)
    one, four = (Planner(m, get_gpu("h100-sxm"), DEFAULT_DS_CONFIG).plan(Layout(1, 8, ep_size=8))
                 for m in (accumulated, planned_model(config4)))
    assert four["bytes"]["activations"] == pytest.approx(one["bytes"]["activations"] / 4)
    assert four["time"]["seconds"]["all_to_all"] > one["time"]["seconds"]["all_to_all"]   # 4x the latencies
