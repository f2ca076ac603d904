"""The router a config asks for (`--gate`), built from its own config."""

from __future__ import annotations

from moe_scale.config import RouterConfig
from moe_scale.moe.router.base import Router


def build_router(config: RouterConfig, d_model: int, num_experts: int, ep_size: int = 1, ep_rank: int = 0) -> Router:
    """The gate of `config`; a gate with parameters that live beside the experts (hierarchical) builds only
    expert-parallel rank `ep_rank`'s share of them."""
    k = config.top_k
    if config.gate == "noisy_topk":
        from moe_scale.moe.router.noisy_topk import NoisyTopKRouter

        return NoisyTopKRouter(d_model, num_experts, k, w_importance=config.w_importance, w_load=config.w_load,
                               noisy=config.noisy_gating)
    if config.gate == "hierarchical":
        from moe_scale.moe.router.hierarchical import HierarchicalRouter

        h = config.hierarchical
        return HierarchicalRouter(d_model, h.num_groups, num_experts // h.num_groups, k_primary=k,
                                  k_secondary=h.top_k_secondary, w_importance=config.w_importance,
                                  w_load=config.w_load, noisy=config.noisy_gating, ep_size=ep_size,
                                  ep_rank=ep_rank)
    if config.gate == "batchwise":
        from moe_scale.moe.router.batchwise import BatchwiseRouter

        return BatchwiseRouter(d_model, num_experts, k, w_importance=config.w_importance,
                               threshold_reduction=config.batchwise.threshold_reduction,
                               scope=config.batchwise.scope)
    if config.gate == "softmax_topk":
        from moe_scale.moe.router.softmax_topk import SoftmaxTopKRouter

        s = config.softmax_topk
        return SoftmaxTopKRouter(d_model, num_experts, k, aux_weight=s.aux_weight, z_weight=s.z_weight,
                                 renormalize=s.renormalize)
    raise ValueError(f"unknown gate {config.gate!r}")
