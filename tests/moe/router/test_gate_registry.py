"""The gate registry (moe/router/build.py's GATES): every gate answers what the rest of moe_scale asks of it
(base.py's GATE_OWNS), each answer held against the gate as built, and docs/moe-design.md's "Adding a gate" lists
exactly those."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from moe_scale.config import RouterConfig, RunConfig
from moe_scale.moe.build import build_moe_layer
from moe_scale.moe.router import GATE_OWNS, GATES, Router
from tests.paths import REPO

D, E = 8, 8


def _config(gate: str) -> RunConfig:
    config = RunConfig.from_settings(gate=gate, d_model=D, num_experts=E, top_k=2, expert_hidden=12)
    if gate == "hierarchical":
        config.set("num_groups", 4)
        config.set("top_k_secondary", 2)
    config.validate()
    return config


def test_the_config_offers_the_registered_gates():
    assert RunConfig.leaves()["gate"].field.metadata["choices"] == tuple(GATES)


@pytest.mark.parametrize("gate", GATES)
def test_every_gate_answers_what_is_asked_of_it(gate):
    cls, config = GATES[gate], _config(gate)
    router = config.moe.router
    assert cls.name == gate and issubclass(cls, Router)
    assert all(hasattr(cls, what) for what in GATE_OWNS)
    # its own section of flags: they apply with this gate (and the section exists)
    if cls.section is not None:
        section = getattr(router, cls.section)
        assert dataclasses.is_dataclass(section)
        for key, leaf in RunConfig.leaves().items():
            if leaf.path[:3] == ("moe", "router", cls.section):
                assert config.inapplicable(key) is None, key
    # the layer it needs, and the units a token's rows go to
    torch.manual_seed(0)
    layer = build_moe_layer(config.moe, D)
    assert layer.routes_around_the_exchange == cls.routes_around_the_exchange == layer.router.routes_around_the_exchange
    assert layer.dispatch_units()[0] == cls.dispatch_units(router, E)
    # its parameters as counted for flops and plan: the layer's, less the experts'
    params, macs = cls.gating_counts(router, D, E)
    expert_params = layer.experts.w_in.numel() + layer.experts.w_out.numel()
    assert params == sum(p.numel() for p in layer.parameters()) - expert_params
    assert macs >= D * cls.dispatch_units(router, E)
    # the experts that compute for a token
    x = torch.randn(16, D)
    with torch.no_grad():
        layer.train()(x)
    assert cls.active_experts(router) == router.top_k * (router.hierarchical.top_k_secondary
                                                           if cls.routes_around_the_exchange else 1)
    assert isinstance(cls.expert_stats_in_one_process, bool) and isinstance(cls.exports_as_mixtral(router), bool)


def test_a_flat_gate_routes_its_active_experts_per_token():
    """k pairs a token (batchwise: k·N pairs over the batch, a token's share varying)."""
    for gate, cls in GATES.items():
        if cls.routes_around_the_exchange:
            continue
        config = _config(gate)
        out = build_moe_layer(config.moe, D).router(torch.randn(16, D))
        assert out.pairs()[0].numel() == 16 * cls.active_experts(config.moe.router), gate


def test_the_docs_list_what_a_gate_owns():
    text = (REPO / "docs" / "moe-design.md").read_text()
    section = text.split("Adding a gate", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"`(\w+)`", section)) >= set(GATE_OWNS)
    listed = re.findall(r"^\s*- `(\w+)`", section, re.M)
    assert sorted(listed) == sorted(GATE_OWNS), listed


def test_the_gate_section_is_the_config_of_that_gate_only():
    sections = {cls.section for cls in GATES.values() if cls.section}
    assert sections <= {f.name for f in dataclasses.fields(RouterConfig)}
