"""The contracts between a routed layer's parts: every gate returns one RouterOutput in the gate's precision,
each gate and layer is built from its own config, and no layer reads the dispatcher's state fields."""

import ast
from dataclasses import replace

import pytest
import torch

from moe_scale.config import (AuxFreeConfig, HierarchicalConfig, MoEConfig, NodeLimitedConfig, RouterConfig,
                              SoftmaxTopKConfig)
from moe_scale.moe.build import build_moe_layer
from moe_scale.moe.hierarchical_layer import HierarchicalMoELayer
from moe_scale.moe.layer import MoELayer
from moe_scale.moe.router import (BatchwiseRouter, HierarchicalRouter, NoisyTopKRouter, RouterOutput,
                                  SoftmaxTopKRouter, build_router)
from moe_scale.moe.router.build import GATES
from tests.paths import REPO
from tests.moe.layers import moe_layer, hierarchical_layer

D, E = 16, 8
CONFIGS = {
    "noisy_topk": RouterConfig(gate="noisy_topk", top_k=2, w_importance=0.3, w_load=0.2, noisy_gating=False),
    "hierarchical": RouterConfig(gate="hierarchical", top_k=2, w_importance=0.3, w_load=0.2,
                                 hierarchical=HierarchicalConfig(num_groups=4, top_k_secondary=1)),
    "batchwise": RouterConfig(gate="batchwise", top_k=2, w_importance=0.3),
    "softmax_topk": RouterConfig(gate="softmax_topk", top_k=3,
                                 softmax_topk=SoftmaxTopKConfig(aux_weight=0.5, z_weight=0.25,
                                                                renormalize="detached")),
    "aux_free": RouterConfig(gate="aux_free", top_k=2,
                             aux_free=AuxFreeConfig(score="softmax", bias_update_rate=0.02, seq_balance_weight=0.1)),
    "node_limited": RouterConfig(gate="node_limited", top_k=2, w_importance=0.3,
                                 aux_free=AuxFreeConfig(bias_update_rate=0.02),
                                 node_limited=NodeLimitedConfig(expert_groups=4, group_top_k=2,
                                                                routed_scaling_factor=2.5)),
}


def test_every_gate_a_config_names_has_a_test_here():
    assert set(GATES) == set(CONFIGS) == set(RouterConfig.__dataclass_fields__["gate"].metadata["choices"])


@pytest.mark.parametrize("gate", sorted(CONFIGS))
def test_each_router_is_built_from_its_own_config(gate):
    config = CONFIGS[gate]
    router = build_router(config, D, E)
    assert type(router) is GATES[gate]
    if gate == "hierarchical":
        assert (router.num_groups, router.experts_per_group, router.k_primary, router.k_secondary) == (4, 2, 2, 1)
        assert (router.w_importance, router.w_load) == (0.3, 0.2)
    elif gate == "noisy_topk":
        assert (router.k, router.w_importance, router.w_load, router.noisy) == (2, 0.3, 0.2, False)
    elif gate == "batchwise":
        assert (router.k, router.w_importance, router.scope) == (2, 0.3, "local")
    elif gate == "aux_free":
        assert (router.k, router.score, router.bias_update_rate, router.seq_balance_weight) == (2, "softmax", 0.02,
                                                                                               0.1)
    elif gate == "node_limited":
        assert (router.k, router.groups, router.group_top_k, router.routed_scaling_factor, router.w_importance,
                router.bias_update_rate) == (2, 4, 2, 2.5, 0.3, 0.02)
    else:
        assert (router.k, router.aux_weight, router.z_weight, router.renormalize) == (3, 0.5, 0.25, "detached")


@pytest.mark.parametrize("gate", sorted(CONFIGS))
@pytest.mark.parametrize("training", [True, False])
def test_every_gate_returns_one_router_output(gate, training):
    torch.manual_seed(0)
    router = build_router(CONFIGS[gate], D, E).train(training)
    x = torch.randn(40, D)
    out = router(x)
    assert type(out) is RouterOutput
    assert out.token_C.dtype == out.expert_C.dtype == torch.int64
    assert out.token_C.shape == out.expert_C.shape == out.gate_C.shape
    assert bool((out.token_C[1:] >= out.token_C[:-1]).all())      # token-major
    assert out.importance_E.shape == out.load_E.shape == (E,)
    assert out.aux_loss.shape == ()
    if gate == "batchwise":     # a variable number of experts per token: no [N, K] view
        assert out.top_k is None
        with pytest.raises(AttributeError, match="variable number"):
            out.gates_NK
    else:
        k = router.k
        assert out.gates_NK.shape == out.experts_NK.shape == (40, k)
        assert torch.equal(out.token_C, torch.arange(40).repeat_interleave(k))
        assert torch.equal(out.experts_NK.reshape(-1), out.expert_C)


@pytest.mark.parametrize("gate", sorted(CONFIGS))
def test_the_base_class_runs_every_gate_in_float32_with_autocast_off(gate):
    """bf16 activations under bf16 autocast route exactly as their float32 values do."""
    torch.manual_seed(1)
    router = build_router(CONFIGS[gate], D, E).eval()
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    x_bf16 = torch.randn(32, D).to(torch.bfloat16)
    reference = router(x_bf16.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x_bf16)
    assert out.gate_C.dtype == torch.float32
    assert torch.equal(out.expert_C, reference.expert_C)
    torch.testing.assert_close(out.gate_C, reference.gate_C, rtol=0, atol=0)


def test_the_moe_layer_a_config_asks_for():
    moe = MoEConfig()
    flat = build_moe_layer(moe, D)
    two_level = build_moe_layer(replace(moe, router=CONFIGS["hierarchical"]), D)
    assert type(flat) is MoELayer and isinstance(flat.router, NoisyTopKRouter)
    assert type(two_level) is HierarchicalMoELayer and isinstance(two_level.router, HierarchicalRouter)
    # the dispatcher of the two-level layer sends tokens to groups
    assert two_level.dispatcher.num_experts == 4


def test_a_layer_refuses_a_gate_of_the_other_kind():
    with pytest.raises(ValueError, match="HierarchicalMoELayer"):
        moe_layer(D, 32, E, 2, router=HierarchicalRouter(D, 4, 2))
    with pytest.raises(ValueError, match="HierarchicalMoELayer"):
        hierarchical_layer(D, 32, E, 2, router=SoftmaxTopKRouter(D, E, 2))
    moe_layer(D, 32, E, 2, router=BatchwiseRouter(D, E, 2))     # any flat gate


LAYER_FILES = ["moe_scale/moe/layer.py", "moe_scale/moe/hierarchical_layer.py", "moe_scale/attention/moa.py"]


@pytest.mark.parametrize("path", LAYER_FILES)
def test_no_layer_reads_the_dispatch_state_fields(path):
    """A layer asks the dispatcher's state through its methods (`state.expert_counts()`), so the state can change
    its fields without breaking a layer."""
    tree = ast.parse((REPO / path).read_text())
    calls = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    reads = [f"line {node.lineno}: state.{node.attr}" for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "state"
             and id(node) not in calls]
    assert not reads, reads
    assert any(isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "state"
               for node in ast.walk(tree))     # the check sees the state at all
