"""The MoE layer a config asks for: flat, or two-level for the hierarchical gate."""

from __future__ import annotations

from moe_scale.config import MoEConfig
from moe_scale.moe.hierarchical_layer import HierarchicalMoELayer
from moe_scale.moe.layer import MoELayer
from moe_scale.moe.router import build_router, gate_class


def build_moe_layer(config: MoEConfig, d_model: int, ep_size: int = 1, ep_rank: int = 0,
                    seed: int = 0, kind: str = "relu") -> MoELayer:
    """The layer of `config` (router, dispatch and experts settings) at width `d_model`; `kind`: its experts'
    (moe/experts/kinds.py; the run's RunConfig.expert_kind, which resolves `--expert-kind block`)."""
    experts, dispatch = config.experts, config.dispatch
    layer = HierarchicalMoELayer if gate_class(config.router).routes_around_the_exchange else MoELayer
    return layer(d_model, experts.hidden, experts.num_experts, config.router.top_k, ep_size=ep_size,
                 ep_rank=ep_rank, seed=seed,
                 router=build_router(config.router, d_model, experts.num_experts, ep_size, ep_rank),
                 recompute=experts.recompute, dispatch_mode=dispatch.mode, capacity_factor=dispatch.capacity_factor,
                 all_to_all=dispatch.all_to_all, node_size=dispatch.node_size, reuse_grad_buffers=experts.grad_reuse,
                 shared_experts=experts.shared, shared_hidden=experts.shared_hidden, shared_gate=experts.shared_gate,
                 activation=kind)
