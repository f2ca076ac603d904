"""The router a config asks for (`--gate`), built from its own config."""

from __future__ import annotations

from moe_scale.config import RouterConfig
from moe_scale.moe.router.aux_free import AuxFreeRouter
from moe_scale.moe.router.base import Router
from moe_scale.moe.router.batchwise import BatchwiseRouter
from moe_scale.moe.router.hierarchical import HierarchicalRouter
from moe_scale.moe.router.node_limited import NodeLimitedRouter
from moe_scale.moe.router.noisy_topk import NoisyTopKRouter
from moe_scale.moe.router.softmax_topk import SoftmaxTopKRouter

GATES: dict[str, type[Router]] = {gate.name: gate for gate in (NoisyTopKRouter, HierarchicalRouter, BatchwiseRouter,
                                                                SoftmaxTopKRouter, AuxFreeRouter, NodeLimitedRouter)}


def gate_class(config: RouterConfig) -> type[Router]:
    """The class of `config`'s gate: what the rest of moe_scale asks about the gate (base.py's GATE_OWNS)."""
    if config.gate not in GATES:
        raise ValueError(f"unknown gate {config.gate!r}; one of {sorted(GATES)}")
    return GATES[config.gate]


def build_router(config: RouterConfig, d_model: int, num_experts: int, ep_size: int = 1, ep_rank: int = 0) -> Router:
    """The gate of `config`; a gate with parameters that live beside the experts (hierarchical) builds only
    expert-parallel rank `ep_rank`'s share of them."""
    return gate_class(config).from_config(config, d_model, num_experts, ep_size, ep_rank)
