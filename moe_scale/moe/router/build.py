"""Build the router a model config asks for (`--gate`). Every router returns an object with `pairs()`,
`aux_loss`, `importance_E`, `load_E` and `metrics`, and is wired to the network by the layer only."""

from __future__ import annotations

from torch import nn

from moe_scale.config import ModelConfig


def build_router(config: ModelConfig) -> nn.Module:
    d, n, k = config.d_model, config.num_experts, config.top_k
    if config.gate == "noisy_topk":
        from moe_scale.moe.router.noisy_topk import NoisyTopKRouter

        return NoisyTopKRouter(d, n, k, w_importance=config.w_importance, w_load=config.w_load,
                               noisy=config.noisy_gating)
    if config.gate == "hierarchical":
        from moe_scale.moe.router.hierarchical import HierarchicalRouter

        return HierarchicalRouter(d, config.num_groups, n // config.num_groups, k_primary=k,
                                  k_secondary=config.top_k_secondary, w_importance=config.w_importance,
                                  w_load=config.w_load, noisy=config.noisy_gating)
    if config.gate == "batchwise":
        from moe_scale.moe.router.batchwise import BatchwiseRouter

        return BatchwiseRouter(d, n, k, w_importance=config.w_importance,
                               threshold_reduction=config.threshold_reduction, scope=config.batchwise_scope)
    if config.gate == "softmax_topk":
        from moe_scale.moe.router.softmax_topk import SoftmaxTopKRouter

        return SoftmaxTopKRouter(d, n, k, aux_weight=config.moa_aux_weight, z_weight=config.moa_z_weight,
                                 renormalize=config.moa_renormalize)
    raise ValueError(f"unknown gate {config.gate!r}")
