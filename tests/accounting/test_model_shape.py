"""The planner's model description against real built models: parameter counts, the factored optimizer's state,
the expert-parallel split, FLOPs per token, and the expected rows a token sends."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moe_scale.accounting.model_shape import ExpertLayer, planned_model
from moe_scale.config import RunConfig
from moe_scale.accounting.model_flops import forward_macs_per_token
from moe_scale.models.build import build_model
from moe_scale.train.engine import optimizer_groups
from moe_scale.train.factored_optimizer import build_optimizer, optimizer_state_numel

VOCAB = 500
CONFIGS = {
    "lstm-moe flat": dict(d_model=32, expert_hidden=48, num_experts=8, top_k=2),
    "lstm-moe hierarchical": dict(d_model=32, expert_hidden=48, gate="hierarchical", num_groups=4, num_experts=16,
                                  top_k=2, top_k_secondary=2),
    "transformer moe": dict(model="transformer", ffn="moe", num_layers=2, d_model=32, expert_hidden=48,
                            num_experts=8),
    "transformer moa": dict(model="transformer", attention="moa", moa_num_experts=4, moa_top_k=2, num_layers=2,
                            d_model=32),
}


def _config(settings: dict) -> RunConfig:
    config = RunConfig.from_settings(vocab_size=VOCAB, optimizer="factored", **settings)
    config.validate()
    return config


@pytest.mark.parametrize("name", CONFIGS)
def test_counts_equal_the_built_model(name):
    config = _config(CONFIGS[name])
    planned = planned_model(config)
    torch.manual_seed(0)
    model = build_model(config, VOCAB)
    sharded = sum(shard.param.numel() for layer in model.moe_layers() for shard in layer.expert_shards().values())
    assert planned.total_params == sum(p.numel() for p in model.parameters())
    assert planned.sharded_params == sharded > 0
    # the factored optimizer's state after one step, exactly
    optimizer = build_optimizer(optimizer_groups(model), config.train)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    assert planned.factored_state == optimizer_state_numel(optimizer, factored_only=True)
    # one rank of two holds the dense parameters, half of the sharded ones and half the vocabulary tables' rows;
    # with one expert-parallel rank per process or none, the tables are split over the processes all the same
    data_parallel = build_model(config, VOCAB, world=2, rank=1)
    assert sum(p.numel() for p in data_parallel.parameters()) == planned.params_per_gpu(1, 2) == \
        planned.dense_params + planned.sharded_params + planned.vocab_params // 2
    half = build_model(config, VOCAB, ep_size=2, ep_rank=1, world=2, rank=1)
    assert sum(p.numel() for p in half.parameters()) == planned.params_per_gpu(2, 2) == \
        planned.dense_params + planned.sharded_params // 2 + planned.vocab_params // 2
    if config.attention.kind != "moa":   # --etp-size 2 beside 2 expert-parallel ranks: a quarter of the experts'
        config.moe.experts.tensor_parallel = 2   # units each, half of what is copied (the secondary gates)
        quarter = build_model(config, VOCAB, ep_size=4, ep_rank=3, world=4, rank=3)
        copied = planned.copied_params
        assert (copied > 0) == (config.moe.router.gate == "hierarchical")
        assert sum(p.numel() for p in quarter.parameters()) == planned.params_per_gpu(4, 4, etp_size=2) == \
            planned.dense_params + (planned.sharded_params - copied) // 4 + copied // 2 + planned.vocab_params // 4
    # FLOPs per token by train's own rule (train/report.py)
    macs = {**forward_macs_per_token(config, VOCAB, config.data.seq_len),
            "softmax": model.softmax.forward_macs_per_token()}
    assert planned.flops_per_token == 6 * sum(macs.values())


def test_expert_layers_say_what_travels():
    flat = planned_model(_config(CONFIGS["lstm-moe flat"])).expert_layers
    assert flat == (ExpertLayer("moe", 8, 2, 2, 48),)
    hierarchical = planned_model(_config(CONFIGS["lstm-moe hierarchical"])).expert_layers
    assert hierarchical == (ExpertLayer("moe", 4, 2, 4, 48),)      # rows go to groups; 2 x 2 experts compute
    transformer = planned_model(_config(CONFIGS["transformer moe"])).expert_layers
    assert len(transformer) == 2
    moa = planned_model(_config(CONFIGS["transformer moa"])).expert_layers
    assert moa == (ExpertLayer("moa", 4, 2, 2, 16, 32),) * 2        # head width 32 / k, K and V gathered


def test_recompute_adds_the_experts_first_product():
    planned = planned_model(_config(CONFIGS["lstm-moe hierarchical"]))
    assert planned.recompute_flops_per_token == 2 * 4 * 32 * 48    # 4 active experts, d x h MACs each


@pytest.mark.parametrize("units,picks,ranks", [(8, 2, 4), (8, 2, 8), (16, 4, 4), (4, 2, 2), (6, 3, 3)])
def test_distinct_ranks_is_the_mean_over_every_choice_of_units(units, picks, ranks):
    layer = ExpertLayer("moe", units, picks, picks, 1)
    per_rank = units // ranks
    choices = list(itertools.combinations(range(units), picks))
    mean = sum(len({u // per_rank for u in chosen}) for chosen in choices) / len(choices)
    assert layer.distinct_ranks(ranks) == pytest.approx(mean, rel=1e-12)
    assert layer.distinct_ranks(1) == 1.0


def test_activations_by_hand_for_the_lstm_moe():
    planned = planned_model(_config(CONFIGS["lstm-moe flat"]))
    d = 32
    # embedding output, two LSTMs (7 x units), gate logits (W_g and W_noise: 2 x 8), sigmoid, softmax logits,
    # three more layer outputs (LSTM, MoE, LSTM); masks on the four outputs
    assert planned.activation_values_per_token == d + 2 * 7 * d + 2 * 8 + d + VOCAB + 3 * d
    assert planned.masks_per_token == 4 * d
    assert math.isclose(planned.flops_per_token, 6 * (2 * 4 * d * 2 * d + 2 * d * 8 + 2 * 2 * d * 48 + d * VOCAB))
