"""MoELayer: dense reference, DeepSpeed's view of it (isinstance, param flags, state-dict keys), and
2 and 4 expert-parallel ranks == 1 process (outputs, aux loss, gradients; both gates, both exchanges)."""

import math
import os
import re

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from torch import nn

from moe_scale.moe.losses import cv_squared
from moe_scale.moe.router import GlobalTokenNoise, HierarchicalRouter, NodeLimitedRouter
from tests.multiproc import run_ranks
from tests.moe.layers import hierarchical_layer, moe_layer, randomized

D, H, E, K = 8, 16, 8, 2
EXPERT_KEY = re.compile(r"(^|.*\.)deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(w_in|w_out)$")


def make_layer(ep_size=1, ep_rank=0, seed=0, gate_seed=1, **kw):
    """float64 layer with a non-zero gate (the zero init would route by ties only)."""
    two_level = isinstance(kw.get("router"), HierarchicalRouter)
    layer = (hierarchical_layer if two_level else moe_layer)(D, H, E, K, ep_size=ep_size, ep_rank=ep_rank,
                                                                seed=seed, **kw).double()
    if kw.get("router") is not None:        # the caller initialised its own router
        return layer
    gen = torch.Generator().manual_seed(gate_seed)
    with torch.no_grad():
        layer.router.w_gate.copy_(torch.randn(D, E, generator=gen, dtype=torch.float64))
        layer.router.w_noise.copy_(torch.randn(D, E, generator=gen, dtype=torch.float64) * 0.3)
    return layer


def make_batch(n=32, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, D, generator=gen, dtype=torch.float64),
            torch.randn(n, D, generator=gen, dtype=torch.float64))    # x, upstream gradient


def dense_reference(layer, x):
    """Clean top-k routing and each selected expert's FFN, token by token; returns (y, aux)."""
    logits = x @ layer.router.w_gate
    top, experts = logits.topk(K, dim=1)
    gates = torch.softmax(top, dim=1)
    w_in, w_out = layer.experts.w_in, layer.experts.w_out
    y = torch.stack([
        sum(gates[n, j] * (torch.relu(x[n] @ w_in[experts[n, j]].t()) @ w_out[experts[n, j]]) for j in range(K))
        for n in range(x.shape[0])]) * math.sqrt(D / H)
    importance = torch.zeros(E, dtype=x.dtype).index_add(0, experts.reshape(-1), gates.reshape(-1))
    load = torch.bincount(experts.reshape(-1), minlength=E).to(x.dtype)
    return y, 0.1 * cv_squared(importance) + 0.1 * cv_squared(load), experts


# ---------------------------------------------------------------- one process


def test_forward_and_grads_match_dense_reference():
    layer = make_layer().eval()
    x, upstream = make_batch()
    x.requires_grad_(True)
    y, aux = layer(x)
    ref_y, ref_aux, experts = dense_reference(layer, x)
    assert len(torch.unique(experts)) >= 6, "routing should be non-trivial for this test to mean anything"
    torch.testing.assert_close(y, ref_y)
    torch.testing.assert_close(aux, ref_aux)
    params = (x, layer.router.w_gate, layer.experts.w_in, layer.experts.w_out)
    got = torch.autograd.grad((y * upstream).sum() + aux, params)
    want = torch.autograd.grad((ref_y * upstream).sum() + ref_aux, params)
    for g, r, name in zip(got, want, ("x", "w_gate", "w_in", "w_out")):
        assert torch.count_nonzero(g) > 0, name
        torch.testing.assert_close(g, r, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_training_backward_reaches_every_parameter():
    layer = make_layer().train()
    layer.router.noise_sampler = GlobalTokenNoise(seed=3, layer_index=0, rank=0, world_size=1)
    x, upstream = make_batch()
    y, aux = layer(x)
    ((y * upstream).sum() + aux).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name
    assert y.dtype == x.dtype and layer.stats.importance_E.shape == (E,)
    assert layer.stats.importance_E.sum().item() == pytest.approx(x.shape[0])   # gates of a token sum to 1


def test_float32_input_keeps_dtype():
    layer = moe_layer(D, H, E, K).eval()
    y, aux = layer(torch.randn(5, D))
    assert y.dtype == torch.float32 and y.shape == (5, D) and aux.dim() == 0


def test_is_a_deepspeed_moe_with_expert_param_flags():
    layer = moe_layer(D, H, E, K, ep_size=2, ep_rank=1)
    assert isinstance(layer, DeepSpeedMoE)
    assert (layer.num_experts, layer.num_local_experts, layer.ep_size) == (E, E // 2, 2)
    assert layer.expert_group_name == "ep_size_2"
    expert_params = {id(layer.experts.w_in), id(layer.experts.w_out)}
    for name, p in layer.named_parameters():
        if id(p) in expert_params:
            assert p.allreduce is False and p.group_name == "ep_size_2" and is_moe_param(p), name
        else:
            assert not is_moe_param(p) and not hasattr(p, "group_name"), name
    # What the engine's optimizer setup does with them: experts get their own group.
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(layer.parameters()), "name": "all"})
    moe_groups = [g for g in groups if g.get("moe")]
    assert len(moe_groups) == 1 and moe_groups[0]["name"] == "ep_size_2"
    assert {id(p) for p in moe_groups[0]["params"]} == expert_params


def test_ep_size_must_divide_experts_and_forward_needs_groups():
    with pytest.raises(ValueError, match="divisible"):
        moe_layer(D, H, 6, K, ep_size=4)
    with pytest.raises(RuntimeError, match="set_deepspeed_parallelism"):
        moe_layer(D, H, E, K, ep_size=2)(torch.randn(3, D))


# ---------------------------------------------------------------- state dict


def test_state_dict_keys_are_per_expert_as_deepspeed_expects():
    model = nn.ModuleDict({"moe": moe_layer(D, H, E, K, ep_size=2, ep_rank=1, seed=4)})
    layer = model["moe"]
    sd = model.state_dict()
    expert_keys = {k for k in sd if EXPERT_KEY.match(k)}
    want = {f"moe.deepspeed_moe.experts.deepspeed_experts.{i}.{n}" for i in range(4) for n in ("w_in", "w_out")}
    assert expert_keys == want
    assert set(sd) - expert_keys == {"moe.router.w_gate", "moe.router.w_noise"}
    assert not any("expert" in k for k in set(sd) - expert_keys)    # DeepSpeed treats these as expert weights
    for i in range(4):
        assert torch.equal(sd[f"moe.deepspeed_moe.experts.deepspeed_experts.{i}.w_in"], layer.experts.w_in[i])
        assert torch.equal(sd[f"moe.deepspeed_moe.experts.deepspeed_experts.{i}.w_out"], layer.experts.w_out[i])
    # The state dict is a snapshot: not a live handle that autograd or an optimizer would write through.
    assert all(not t.requires_grad for t in sd.values())
    # What the engine's _save_moe_checkpoint sees: module-level keys, "expert" selects exactly ours.
    assert {k for k in layer.state_dict() if "expert" in k} == {k[len("moe."):] for k in expert_keys}


def test_state_dict_round_trip_into_fresh_layer():
    src = nn.ModuleDict({"moe": make_layer(ep_size=2, ep_rank=0, seed=4, gate_seed=5)})
    dst = nn.ModuleDict({"moe": make_layer(ep_size=2, ep_rank=0, seed=9, gate_seed=6)})
    assert not torch.equal(src["moe"].experts.w_in, dst["moe"].experts.w_in)
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    result = dst.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for (name, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert torch.equal(a, b), name
    assert dst["moe"].experts.w_in.is_leaf and dst["moe"].experts.w_in.shape == (4, H, D)
    assert set(dst.state_dict()) == set(sd)
    for k in sd:
        assert torch.equal(dst.state_dict()[k], sd[k]), k
    # The caller's dict is not consumed by the loading hook.
    assert set(sd) == set(src.state_dict())


def test_load_rejects_a_missing_expert():
    src, dst = moe_layer(D, H, E, K, seed=1), moe_layer(D, H, E, K, seed=2)
    sd = src.state_dict()
    del sd["deepspeed_moe.experts.deepspeed_experts.3.w_out"]
    with pytest.raises(RuntimeError):
        dst.load_state_dict(sd, strict=True)


# ---------------------------------------------------------------- 2 expert-parallel ranks (gloo + DeepSpeed groups)


def _setup(layer, mode, rank, world):
    if mode == "eval":
        layer.eval()
    else:                                   # training, noisy gating, the same noise per global token
        layer.train()
        if hasattr(layer.router, "noise_sampler"):
            layer.router.noise_sampler = GlobalTokenNoise(seed=7, layer_index=0, rank=rank, world_size=world)


def _single_process_reference(mode, router=None):
    """The whole batch through one process's layer, forward and backward: (layer, x, y, aux)."""
    single = make_layer(ep_size=1, seed=3, router=router)
    _setup(single, mode, 0, 1)
    x, upstream = make_batch()
    x.requires_grad_(True)
    y, aux = single(x)
    ((y * upstream).sum() + aux).backward()
    return single, x, y, aux


def _two_rank_worker(rank, world, mode):
    layer = make_layer(ep_size=world, ep_rank=rank, seed=3)
    layer.set_deepspeed_parallelism()
    _setup(layer, mode, rank, world)
    x_all, up_all = make_batch()
    n = x_all.shape[0] // world
    x = x_all[rank * n:(rank + 1) * n].clone().requires_grad_(True)
    y, aux = layer(x)
    # Per-rank losses sum to the single-process loss: each rank carries 1/world of the (global) aux loss.
    ((y * up_all[rank * n:(rank + 1) * n]).sum() + aux / world).backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return {"y": y.detach(), "aux": aux.detach(), "x_grad": x.grad, "grads": grads,
            "importance": layer.stats.importance_E, "load": layer.stats.load_E,
            "w_in": layer.experts.w_in.detach()}


def _wrong_rank_worker(rank, world):
    layer = moe_layer(D, H, E, K, ep_size=world, ep_rank=world - 1 - rank)
    with pytest.raises(RuntimeError, match="expert-parallel rank"):
        layer.set_deepspeed_parallelism()
    return True


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["eval", "train_noisy"])
def test_two_expert_parallel_ranks_equal_one_process(mode):
    results = run_ranks(_two_rank_worker, world_size=2, args=(mode,), deepspeed=True, timeout=60)
    single, x, y, aux = _single_process_reference(mode)

    n, local = x.shape[0] // 2, E // 2
    for rank, res in enumerate(results):
        mine, experts = slice(rank * n, (rank + 1) * n), slice(rank * local, (rank + 1) * local)
        torch.testing.assert_close(res["w_in"], single.experts.w_in[experts].detach(), rtol=0, atol=0)
        torch.testing.assert_close(res["y"], y[mine].detach())
        torch.testing.assert_close(res["aux"], aux.detach())
        torch.testing.assert_close(res["importance"], single.stats.importance_E)
        torch.testing.assert_close(res["load"], single.stats.load_E)
        torch.testing.assert_close(res["x_grad"], x.grad[mine])
        # Expert weights are not replicated: each rank's gradient is its slice of the full one.
        torch.testing.assert_close(res["grads"]["experts.w_in"], single.experts.w_in.grad[experts])
        torch.testing.assert_close(res["grads"]["experts.w_out"], single.experts.w_out.grad[experts])
    # The router is replicated: data-parallel reduction (a sum here) gives the single-process gradient.
    for name in ("router.w_gate", "router.w_noise"):
        want = dict(single.named_parameters())[name].grad
        if want is None:                      # w_noise in eval mode: no path at all
            assert all(res["grads"][name] is None for res in results)
        else:
            assert torch.count_nonzero(want) > 0
            got = sum(res["grads"][name] for res in results)
            torch.testing.assert_close(got, want, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.multiprocess
def test_two_ranks_refuse_a_mismatched_expert_parallel_rank():
    assert run_ranks(_wrong_rank_worker, world_size=2, deepspeed=True, timeout=60) == [True, True]


# ---------------------------------------------------------------- 4 expert-parallel ranks, both gates, both exchanges


def _router(gate):
    if gate == "noisy_topk":
        return None
    if gate == "node_limited":   # 4 groups of 2 experts, each token's 2 experts from 2 groups; biases set
        router = NodeLimitedRouter(D, E, 2, groups=4, group_top_k=2,
                                   routed_scaling_factor=2.5, w_importance=0.1).double()
        with torch.no_grad():
            router.score_bias.copy_(torch.linspace(-0.2, 0.2, E))
    else:
        router = HierarchicalRouter(D, 4, E // 4, k_primary=2, k_secondary=2).double()
    return randomized(router)


def _four_rank_worker(rank, world, gate, all_to_all):
    layer = make_layer(ep_size=world, ep_rank=rank, seed=3, router=_router(gate))
    layer.all_to_all, layer.node_size = all_to_all, 2
    layer.set_deepspeed_parallelism()
    _setup(layer, "train_noisy", rank, world)
    x_all, up_all = make_batch()
    n = x_all.shape[0] // world
    x = x_all[rank * n:(rank + 1) * n].clone().requires_grad_(True)
    y, aux = layer(x)
    ((y * up_all[rank * n:(rank + 1) * n]).sum() + aux / world).backward()
    return {"y": y.detach(), "aux": aux.detach(), "x_grad": x.grad,
            "grads": {name: p.grad for name, p in layer.named_parameters()},
            "exchange": type(layer.dispatcher.exchange).__name__}


@pytest.mark.multiprocess
@pytest.mark.parametrize("gate,all_to_all,world", [("noisy_topk", "flat", 4), ("hierarchical", "hierarchical", 4),
                                                   ("node_limited", "hierarchical", 4), ("node_limited", "flat", 2)])
def test_four_expert_parallel_ranks_equal_one_process(gate, all_to_all, world):
    """(and the node-limited gate on 2 ranks: 1 == 2 == 4 processes)"""
    results = run_ranks(_four_rank_worker, world_size=world, args=(gate, all_to_all), deepspeed=True, timeout=90)
    single, x, y, aux = _single_process_reference("train_noisy", _router(gate))
    n, local = x.shape[0] // world, E // world
    sharded = set(single.expert_shards()) - {"experts.w_in", "experts.w_out"}
    assert sharded == ({"router.w_gate_secondary", "router.w_noise_secondary"} if gate == "hierarchical" else set())
    for rank, res in enumerate(results):
        assert res["exchange"] == ("HierarchicalExchange" if all_to_all == "hierarchical" else "FlatExchange")
        mine, experts = slice(rank * n, (rank + 1) * n), slice(rank * local, (rank + 1) * local)
        torch.testing.assert_close(res["y"], y[mine].detach())
        torch.testing.assert_close(res["aux"], aux.detach())
        torch.testing.assert_close(res["x_grad"], x.grad[mine])
        for name in ("experts.w_in", "experts.w_out"):
            torch.testing.assert_close(res["grads"][name], dict(single.named_parameters())[name].grad[experts])
        for name in sharded:   # the secondary gates live with their groups: rank r holds group r of 4
            torch.testing.assert_close(res["grads"][name],
                                       dict(single.named_parameters())[name].grad[rank:rank + 1])
    for name, param in single.named_parameters():
        if name not in single.expert_shards() and param.grad is not None:   # replicated: ranks sum to it
            torch.testing.assert_close(sum(res["grads"][name] for res in results), param.grad,
                                       msg=lambda m, name=name: f"grad of {name}: {m}")
