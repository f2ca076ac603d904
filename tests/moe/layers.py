"""MoE layers for tests, built the way the library builds them (from an MoEConfig), from the few settings a test
varies: `moe_layer(D, H, E, K, ep_size=2, ep_rank=1, seed=3, router=..., shared_experts=2)`."""

from __future__ import annotations

import torch

from moe_scale.config import MoEConfig
from moe_scale.moe.hierarchical_layer import HierarchicalMoELayer
from moe_scale.moe.layer import MoELayer

_SETTINGS = {   # keyword -> (section, field) of MoEConfig
    "dispatch_mode": ("dispatch", "mode"), "capacity_factor": ("dispatch", "capacity_factor"),
    "all_to_all": ("dispatch", "all_to_all"), "node_size": ("dispatch", "node_size"),
    "rank_capacity_factor": ("dispatch", "rank_capacity_factor"), "a2a_chunks": ("dispatch", "a2a_chunks"),
    "etp_size": ("experts", "tensor_parallel"),
    "recompute": ("experts", "recompute"), "reuse_grad_buffers": ("experts", "grad_reuse"),
    "shared_experts": ("experts", "shared"), "shared_hidden": ("experts", "shared_hidden"),
    "shared_gate": ("experts", "shared_gate"), "w_importance": ("router", "w_importance"),
    "w_load": ("router", "w_load"), "noisy_gating": ("router", "noisy_gating"),
}


def randomized(module, seed: int = 5, scale: float = 0.5):
    """`module` with every parameter drawn N(0, scale^2) from a generator seeded `seed` (a gate that routes by its
    weights, not by the ties of its zero initialisation)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return module


def moe_config(num_experts: int, k: int, hidden: int, **settings) -> MoEConfig:
    config = MoEConfig()
    config.experts.num_experts, config.experts.hidden, config.router.top_k = num_experts, hidden, k
    for key, value in settings.items():
        section, name = _SETTINGS[key]
        setattr(getattr(config, section), name, value)
    return config


def moe_layer(d_model: int, d_hidden: int, num_experts: int, k: int, ep_size: int = 1, ep_rank: int = 0,
              seed: int = 0, router=None, activation: str = "relu", **settings) -> MoELayer:
    return MoELayer(moe_config(num_experts, k, d_hidden, **settings), d_model, ep_size, ep_rank, seed, activation,
                    router=router)


def hierarchical_layer(d_model: int, d_hidden: int, num_experts: int, k: int, ep_size: int = 1, ep_rank: int = 0,
                       seed: int = 0, router=None, activation: str = "relu", **settings) -> HierarchicalMoELayer:
    return HierarchicalMoELayer(moe_config(num_experts, k, d_hidden, **settings), d_model, ep_size, ep_rank, seed,
                                activation, router=router)
