"""Every MoE and attention setting reaches the module it names, in every model that has such a module: each is
set to a value other than its default, the model is built, and the module is read back. (The transformer once
built its MoE layers without --dispatch and --capacity-factor and silently ran dropless.)"""

from __future__ import annotations

import pytest
import torch

from moe_scale.config import RunConfig
from moe_scale.models.build import build_model
from moe_scale.moe.layer import MoELayer

V, T = 30, 8
MODELS = {"lstm": {"model": "lstm"}, "transformer": {"model": "transformer", "ffn": "moe", "num_heads": 2}}
BASE = {"d_model": 16, "num_experts": 8, "top_k": 2, "num_layers": 2}

# (key, a value other than its default, extra settings it needs, what the MoE layer holds for it)
MOE_SETTINGS = [
    ("num_experts", 4, {}, lambda layer: layer.num_experts),
    ("expert_hidden", 24, {}, lambda layer: layer.experts.d_hidden),
    ("expert_kind", "geglu", {"shared_experts": 1},
     lambda layer: layer.experts.kind.name == layer.shared.kind.name == "geglu" and "geglu"),
    ("expert_recompute", True, {}, lambda layer: layer.experts.recompute),
    ("expert_grad_reuse", False, {}, lambda layer: layer.experts.grad_buffers is not None),
    ("top_k", 3, {}, lambda layer: layer.router.k),
    ("w_importance", 0.5, {}, lambda layer: layer.router.w_importance),
    ("w_load", 0.25, {}, lambda layer: layer.router.w_load),
    ("noisy_gating", False, {}, lambda layer: layer.router.noisy),
    ("gate", "batchwise", {}, lambda layer: type(layer.router).__name__ == "BatchwiseRouter" and "batchwise"),
    ("num_groups", 2, {"gate": "hierarchical"}, lambda layer: layer.router.num_groups),
    ("top_k_secondary", 1, {"gate": "hierarchical"}, lambda layer: layer.router.k_secondary),
    ("batchwise_scope", "global", {"gate": "batchwise"}, lambda layer: layer.router.scope),
    ("threshold_reduction", "sum", {"gate": "batchwise"}, lambda layer: layer.router.threshold_reduction),
    ("moa_aux_weight", 0.5, {"gate": "softmax_topk"}, lambda layer: layer.router.aux_weight),
    ("moa_z_weight", 0.25, {"gate": "softmax_topk"}, lambda layer: layer.router.z_weight),
    ("moa_renormalize", "detached", {"gate": "softmax_topk"}, lambda layer: layer.router.renormalize),
    ("aux_free_score", "softmax", {"gate": "aux_free"}, lambda layer: layer.router.score),
    ("bias_update_rate", 0.01, {"gate": "aux_free"}, lambda layer: layer.router.bias_update_rate),
    ("seq_balance_weight", 0.001, {"gate": "aux_free"}, lambda layer: layer.router.seq_balance_weight),
    ("shared_experts", 2, {}, lambda layer: layer.shared.num_shared),
    ("shared_expert_hidden", 12, {"shared_experts": 1}, lambda layer: layer.shared.d_hidden),
    ("shared_expert_gate", True, {"shared_experts": 1}, lambda layer: layer.shared.w_gate is not None),
    ("dispatch", "capacity", {}, lambda layer: layer.dispatcher.mode),
    ("capacity_factor", 1.5, {}, lambda layer: layer.dispatcher.capacity_factor),
    ("all_to_all", "hierarchical", {}, lambda layer: layer.all_to_all),
    ("node_size", 2, {}, lambda layer: layer.node_size),
    ("rank_capacity_factor", 2.0, {}, lambda layer: layer.dispatcher.rank_capacity_factor),
    ("force_balanced_routing", True, {}, lambda layer: layer.force_balanced),
    ("a2a_chunks", 3, {}, lambda layer: layer.a2a_chunks),
    ("etp_size", 2, {}, lambda layer: layer.tensor_parallel == layer.experts.shards == 2 and 2),
    ("expert_groups", 2, {"gate": "node_limited"}, lambda layer: layer.router.groups),
    ("group_top_k", 2, {"gate": "node_limited", "expert_groups": 4}, lambda layer: layer.router.group_top_k),
    ("normalize", False, {"gate": "node_limited"}, lambda layer: layer.router.normalize),
    ("routed_scaling_factor", 2.5, {"gate": "node_limited"}, lambda layer: layer.router.routed_scaling_factor),
]


def _model(*groups: dict, **settings):
    """The model of BASE, then each group of settings, then `settings`, later ones winning."""
    merged = dict(BASE)
    for group in (*groups, settings):
        merged.update(group)
    torch.manual_seed(0)
    config = RunConfig.from_settings(**merged)   # (built as rank 0 of the ranks one copy of the experts spans)
    return build_model(config, V, ep_size=config.expert_ranks, ep_rank=0, seed=0)


def test_the_table_covers_every_moe_setting():
    moe_keys = {key for key, leaf in RunConfig.leaves().items() if leaf.section == "moe"}
    assert moe_keys == {key for key, *_ in MOE_SETTINGS}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("key, value, needs, read", MOE_SETTINGS, ids=[s[0] for s in MOE_SETTINGS])
def test_every_moe_setting_reaches_every_moe_layer(model, key, value, needs, read):
    assert RunConfig().get(key) != value
    layers = [m for m in _model(MODELS[model], needs, {key: value}).modules() if isinstance(m, MoELayer)]
    assert len(layers) == (1 if model == "lstm" else BASE["num_layers"])
    assert all(read(layer) == value for layer in layers), [read(layer) for layer in layers]


def test_capacity_mode_drops_in_both_models():
    for model in MODELS:
        lm = _model(MODELS[model], dispatch="capacity", capacity_factor=0.5)
        lm(torch.randint(0, V, (2, T)), torch.randint(0, V, (2, T)))
        assert all("dropped_fraction" in layer.stats.metrics for layer in lm.moe_layers()), model


@pytest.mark.parametrize("key, value, read", [
    ("moa_num_experts", 4, lambda attn: attn.num_experts),
    ("moa_top_k", 1, lambda attn: attn.k),
    ("moa_aux_weight", 0.5, lambda attn: attn.router.aux_weight),    # MoA's router takes softmax_topk's settings
    ("moa_z_weight", 0.25, lambda attn: attn.router.z_weight),
    ("moa_renormalize", "detached", lambda attn: attn.router.renormalize),
    ("head_dim", 4, lambda attn: attn.head_dim),
])
def test_moa_settings_reach_every_attention_layer(key, value, read):
    lm = _model({"model": "transformer", "attention": "moa", "moa_num_experts": 8, "moa_top_k": 2}, {key: value})
    layers = [block.attn for block in lm.blocks]
    assert len(layers) == BASE["num_layers"] and all(read(attn) == value for attn in layers)


@pytest.mark.parametrize("key, value, read", [
    ("num_heads", 4, lambda block: block.attn.num_heads),
    ("ffn_hidden", 40, lambda block: block.ffn.up.out_features),
    ("dropout", 0.25, lambda block: block.dropout.p),
])
def test_transformer_settings_reach_every_block(key, value, read):
    lm = _model({"model": "transformer"}, {key: value})
    assert all(read(block) == value for block in lm.blocks)


@pytest.mark.parametrize("key, value, read", [
    ("layout", "4xlstm", lambda lm: len(lm.middle_lstms) == 2 and "4xlstm"),
    ("lstm_hidden", 32, lambda lm: lm.lstm1.hidden_size),
    ("ffn_layers", 3, lambda lm: len(lm.ffn.hidden)),
    ("dropout", 0.25, lambda lm: lm.dropout.p),
])
def test_lstm_settings_reach_the_lstm_lm(key, value, read):
    needs = {"layout": "lstm-ffn-lstm"} if key == "ffn_layers" else {}
    assert read(_model({"model": "lstm"}, needs, {key: value})) == value


LLAMA = {"model": "transformer", "block": "llama", "num_heads": 2}


@pytest.mark.parametrize("key, value, needs, read", [
    ("rope_theta", 1e6, {}, lambda lm: {block.attn.rotary.theta for block in lm.blocks} == {1e6} and 1e6),
    ("tie_embeddings", True, {}, lambda lm: lm.softmax.proj.weight is lm.embedding.weight),
    ("ffn_hidden", 40, {}, lambda lm: {block.ffn.down_proj.in_features for block in lm.blocks} == {40} and 40),
    ("expert_hidden", 24, {"ffn": "moe", "gate": "softmax_topk", "moa_renormalize": "full"},
     lambda lm: {(b.ffn.experts.d_hidden, b.ffn.experts.activation) for b in lm.blocks} == {(24, "swiglu")} and 24),
])
def test_llama_block_settings_reach_every_block(key, value, needs, read):
    assert RunConfig().get(key) != value
    lm = _model(LLAMA, needs, {key: value})
    assert all(type(block.norm1).__name__ == "RMSNorm" and block.attn.q_proj.bias is None for block in lm.blocks)
    assert read(lm) == value
