"""The MoE layer a config asks for: flat, or two-level for the hierarchical gate."""

from __future__ import annotations

from moe_scale.config import MoEConfig
from moe_scale.moe.hierarchical_layer import HierarchicalMoELayer
from moe_scale.moe.layer import MoELayer
from moe_scale.moe.router import gate_class


def build_moe_layer(config: MoEConfig, d_model: int, ep_size: int = 1, ep_rank: int = 0,
                    seed: int = 0, kind: str = "relu") -> MoELayer:
    """The layer of `config` (router, dispatch and experts settings) at width `d_model`; `kind`: its experts'
    (moe/experts/kinds.py; the run's RunConfig.expert_kind, which resolves `--expert-kind block`)."""
    layer = HierarchicalMoELayer if gate_class(config.router).routes_around_the_exchange else MoELayer
    return layer(config, d_model, ep_size, ep_rank, seed, kind)
