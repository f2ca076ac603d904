"""Shared experts (DeepSeekMoE, Qwen2-MoE): one dense FFN equals S expert FFNs; with the routed experts zeroed the
MoE layer (flat and hierarchical, every flat gate) is that dense FFN; they are dense parameters, start the same on
every expert-parallel rank, are counted by the FLOP accounting, and 2 expert-parallel ranks equal 1 process."""

import math
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
from deepspeed.moe.utils import is_moe_param

from moe_scale.accounting.flops import lstm_moe_forward_macs_per_token
from moe_scale.accounting.attention_flops import transformer_forward_macs_per_token
from moe_scale.config import RunConfig
from moe_scale.models.build import build_model, parameter_counts
from moe_scale.moe.experts import GroupedExperts
from moe_scale.moe.router import AuxFreeRouter, BatchwiseRouter, HierarchicalRouter, SoftmaxTopKRouter
from moe_scale.moe.shared_experts import SharedExperts
from tests.multiproc import run_ranks
from tests.moe.layers import hierarchical_layer, moe_layer

D, H, E, K = 8, 16, 8, 2


def expert_ffn(x, w_in_FD, w_out_FD):
    """One expert as the routed ones compute it: sqrt(D/F) · relu(x w_in^T) w_out."""
    return torch.relu(x @ w_in_FD.t()) @ w_out_FD * math.sqrt(x.shape[1] / w_in_FD.shape[0])


def test_one_dense_ffn_equals_the_sum_of_its_experts():
    shared = SharedExperts(D, H, 3, seed=4).double()
    x = torch.randn(10, D, dtype=torch.float64)
    want = sum(expert_ffn(x, shared.w_in[s * H:(s + 1) * H], shared.w_out[s * H:(s + 1) * H]) for s in range(3))
    torch.testing.assert_close(shared(x), want)


def test_the_gate_scales_each_token_by_a_learned_sigmoid():
    shared = SharedExperts(D, H, 2, gate=True).double()
    x = torch.randn(10, D, dtype=torch.float64)
    plain = SharedExperts(D, H, 2).double()
    torch.testing.assert_close(shared(x), 0.5 * plain(x))          # w_gate starts at 0: a scale of 1/2
    with torch.no_grad():
        shared.w_gate.copy_(torch.randn(D, dtype=torch.float64))
    torch.testing.assert_close(shared(x), torch.sigmoid(x @ shared.w_gate)[:, None] * plain(x))
    shared(x).sum().backward()
    assert torch.count_nonzero(shared.w_gate.grad) > 0


def test_shared_expert_s_starts_as_routed_expert_e_plus_s_would():
    """Drawn from its own generator: the same on every rank and for every --ep-size, the global RNG untouched."""
    state = torch.get_rng_state()
    shared = SharedExperts(D, H, 2, seed=7, first_id=E)
    assert torch.equal(torch.get_rng_state(), state)
    routed = GroupedExperts(E + 2, D, H, seed=7)
    torch.testing.assert_close(shared.w_in.view(2, H, D), routed.w_in[E:], rtol=0, atol=0)
    torch.testing.assert_close(shared.w_out.view(2, H, D), routed.w_out[E:], rtol=0, atol=0)


def _zero_routed(layer):
    with torch.no_grad():
        layer.experts.w_in.zero_()
        layer.experts.w_out.zero_()
    return layer


def _router(gate):
    return {"noisy_topk": None, "softmax_topk": SoftmaxTopKRouter(D, E, K), "batchwise": BatchwiseRouter(D, E, K),
            "aux_free": AuxFreeRouter(D, E, K, seq_balance_weight=0.1),
            "hierarchical": HierarchicalRouter(D, 4, E // 4, k_primary=2, k_secondary=1)}[gate]


@pytest.mark.parametrize("gate", ["noisy_topk", "softmax_topk", "batchwise", "aux_free", "hierarchical"])
@pytest.mark.parametrize("gated", [False, True])
def test_with_the_routed_experts_zeroed_the_layer_is_the_dense_ffn_of_the_shared_weights(gate, gated):
    torch.manual_seed(0)
    layer_type = hierarchical_layer if gate == "hierarchical" else moe_layer
    layer = _zero_routed(layer_type(D, H, E, K, router=_router(gate), shared_experts=3, shared_hidden=12,
                                    shared_gate=gated, seed=2)).double().train()
    shared = layer.shared
    if gated:
        with torch.no_grad():
            shared.w_gate.normal_()
    x = torch.randn(24, D, dtype=torch.float64, requires_grad=True)
    y, aux = layer(x)
    want = torch.relu(x @ shared.w_in.t()) @ shared.w_out * math.sqrt(D / 12)
    if gated:
        want = want * torch.sigmoid(x @ shared.w_gate)[:, None]
    torch.testing.assert_close(y, want)
    assert torch.count_nonzero(y) > 0
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
    x_grad = x.grad.clone()
    params = [shared.w_in, shared.w_out] + ([shared.w_gate] if gated else [])
    got = [p.grad.clone() for p in params]
    x.grad = None
    for p in params:
        p.grad = None
    (want * upstream).sum().backward()
    for p, g in zip(params, got):
        torch.testing.assert_close(g, p.grad)
    torch.testing.assert_close(x_grad, x.grad)


@pytest.mark.parametrize("gated", [False, True])
def test_swiglu_shared_experts_are_one_dense_swiglu_ffn_of_their_summed_width(gated):
    """The llama block's (Qwen2-MoE's shared_expert): with the routed SwiGLU experts zeroed, the layer is
    sigmoid(x w_gate) · down(silu(gate(x)) * up(x)) of width S·h_s, the sum of S SwiGLU FFNs of width h_s."""
    torch.manual_seed(0)
    layer = moe_layer(D, H, E, K, router=SoftmaxTopKRouter(D, E, K, renormalize="full"), shared_experts=3,
                     shared_hidden=12, shared_gate=gated, seed=2, activation="swiglu")
    layer = _zero_routed(layer).double().train()
    shared = layer.shared
    assert {n for n, _ in shared.named_parameters()} == \
        {"gate_proj.weight", "up_proj.weight", "down_proj.weight"} | ({"w_gate"} if gated else set())
    assert shared.gate_proj.weight.shape == (36, D) and shared.down_proj.weight.shape == (D, 36)
    if gated:
        with torch.no_grad():
            shared.w_gate.normal_()
    x = torch.randn(24, D, dtype=torch.float64, requires_grad=True)
    y, _ = layer(x)
    g, u, w = shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight
    want = sum(((torch.nn.functional.silu(x @ g[s * 12:(s + 1) * 12].t()) * (x @ u[s * 12:(s + 1) * 12].t()))
                @ w[:, s * 12:(s + 1) * 12].t()) for s in range(3))
    if gated:
        want = want * torch.sigmoid(x @ shared.w_gate)[:, None]
    torch.testing.assert_close(y, want)
    assert torch.count_nonzero(y) > 0
    y.sum().backward()
    assert all(torch.count_nonzero(p.grad) > 0 for p in shared.parameters())


def test_swiglu_shared_experts_start_from_their_own_generators():
    """N(0, 0.02²) per expert from routed expert E + s's generator: the same on every rank, the global RNG
    untouched, and kept by the llama block's initialisation."""
    state = torch.get_rng_state()
    one = SharedExperts(D, H, 2, seed=7, first_id=E, activation="swiglu")
    assert torch.equal(torch.get_rng_state(), state)
    two = SharedExperts(D, H, 2, seed=7, first_id=E, activation="swiglu")
    assert torch.equal(one.gate_proj.weight, two.gate_proj.weight) and torch.equal(one.down_proj.weight,
                                                                                   two.down_proj.weight)
    assert 0.01 < one.up_proj.weight.std().item() < 0.03
    config = RunConfig.from_settings(model="transformer", block="llama", ffn="moe", d_model=16, num_heads=2,
                                     num_layers=1, expert_hidden=24, num_experts=4, shared_experts=2,
                                     shared_expert_gate=True)
    lm = build_model(config, 50)
    fresh = SharedExperts(16, 24, 2, gate=True, seed=lm.blocks[0].ffn.shared.seed, first_id=4, activation="swiglu")
    assert torch.equal(lm.blocks[0].ffn.shared.gate_proj.weight, fresh.gate_proj.weight)


def test_without_shared_experts_the_layer_is_as_before():
    torch.manual_seed(0)
    plain = moe_layer(D, H, E, K)
    torch.manual_seed(0)
    none = moe_layer(D, H, E, K, shared_experts=0, shared_hidden=5, shared_gate=True)
    assert none.shared is None and plain.state_dict().keys() == none.state_dict().keys()
    x = torch.randn(6, D)
    torch.testing.assert_close(none.eval()(x)[0], plain.eval()(x)[0], rtol=0, atol=0)


def test_shared_experts_are_dense_parameters_with_checkpoint_safe_names():
    layer = moe_layer(D, H, E, K, ep_size=2, ep_rank=1, shared_experts=2, shared_gate=True)
    names = [n for n, _ in layer.named_parameters() if n.startswith("shared.")]
    assert names == ["shared.w_in", "shared.w_out", "shared.w_gate"]
    assert not set(names) & set(layer.expert_shards())
    assert not any(is_moe_param(p) for n, p in layer.named_parameters() if n in names)
    keys = [k for k in layer.state_dict() if k.startswith("shared.")]
    assert keys == names and not any("expert" in k for k in keys)   # DeepSpeed reads "expert" as an expert weight
    other = moe_layer(D, H, E, K, ep_size=2, ep_rank=0, shared_experts=2, shared_gate=True)
    for name in names:   # the same on every expert-parallel rank
        assert torch.equal(dict(layer.named_parameters())[name], dict(other.named_parameters())[name])


@pytest.mark.parametrize("model", ["lstm", "transformer", "llama"])
def test_the_accounting_counts_the_shared_experts(model):
    settings = dict(model=model, d_model=16, expert_hidden=24, num_experts=4, top_k=2, shared_experts=2,
                    shared_expert_hidden=20, shared_expert_gate=True)
    if model != "lstm":
        settings.update(model="transformer", ffn="moe", num_heads=2, num_layers=2)
    if model == "llama":
        settings.update(block="llama")
    config = RunConfig.from_settings(**settings)
    plain = RunConfig.from_settings(**{**settings, "shared_experts": 0})
    per_layer = 2 * (3 if model == "llama" else 2) * 16 * 20 + 16   # two FFNs d -> 20 -> d and the gate's d
    lm, plain_lm = build_model(config, 50), build_model(plain, 50)
    built = sum(p.numel() for n, p in lm.named_parameters() if ".shared." in n)
    layers = 1 if model == "lstm" else 2
    assert built == layers * per_layer
    assert parameter_counts(lm)["total"] - parameter_counts(plain_lm)["total"] == built
    assert parameter_counts(lm)["experts"] == parameter_counts(plain_lm)["experts"]   # not expert-parallel
    if model == "lstm":
        macs, before = lstm_moe_forward_macs_per_token(config, 50), lstm_moe_forward_macs_per_token(plain, 50)
        assert macs.pop("shared_experts") == per_layer and macs == before
    else:
        macs, before = (transformer_forward_macs_per_token(c, 50, 8) for c in (config, plain))
        assert macs["ffn"] - before["ffn"] == layers * per_layer
        assert macs["attention"] == before["attention"]


def test_the_shared_expert_width_defaults_to_the_routed_experts():
    lm = build_model(RunConfig.from_settings(d_model=16, expert_hidden=24, num_experts=4, shared_experts=3), 50)
    assert (lm.moe.shared.num_shared, lm.moe.shared.d_hidden, lm.moe.shared.w_gate) == (3, 24, None)


# ---------------------------------------------------------------- 2 expert-parallel ranks == 1 process


def _layer(ep_size, ep_rank):
    torch.manual_seed(0)   # the router's init, the same on every rank (the trainer seeds it so)
    layer = moe_layer(D, H, E, K, ep_size=ep_size, ep_rank=ep_rank, seed=3, router=AuxFreeRouter(D, E, K),
                     shared_experts=2, shared_hidden=8, shared_gate=True).double()
    with torch.no_grad():
        layer.shared.w_gate.copy_(torch.linspace(-1, 1, D, dtype=torch.float64))
    return layer


def _batch():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(32, D, generator=gen, dtype=torch.float64), torch.randn(32, D, generator=gen,
                                                                               dtype=torch.float64)


def _two_rank_worker(rank, world):
    layer = _layer(world, rank)
    layer.set_deepspeed_parallelism()
    x_all, up_all = _batch()
    n = x_all.shape[0] // world
    x = x_all[rank * n:(rank + 1) * n].clone().requires_grad_(True)
    y, aux = layer(x)
    ((y * up_all[rank * n:(rank + 1) * n]).sum() + aux / world).backward()
    return {"y": y.detach(), "x_grad": x.grad, "grads": {n: p.grad for n, p in layer.named_parameters()}}


@pytest.mark.multiprocess
def test_two_expert_parallel_ranks_equal_one_process():
    results = run_ranks(_two_rank_worker, world_size=2, deepspeed=True, timeout=60)
    single = _layer(1, 0)
    x, upstream = _batch()
    x.requires_grad_(True)
    y, aux = single(x)
    ((y * upstream).sum() + aux).backward()
    n = x.shape[0] // 2
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["y"], y[rank * n:(rank + 1) * n].detach())
        torch.testing.assert_close(res["x_grad"], x.grad[rank * n:(rank + 1) * n])
    for name in ("shared.w_in", "shared.w_out", "shared.w_gate"):   # dense: the ranks' gradients sum to it
        want = dict(single.named_parameters())[name].grad
        assert torch.count_nonzero(want) > 0
        torch.testing.assert_close(sum(res["grads"][name] for res in results), want)
