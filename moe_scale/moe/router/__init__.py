"""Routers (gates): which experts each token goes to, with which weights, and the balancing losses.

    base.py          Router (the base every gate derives from: precision, batch collectives) and RouterOutput
                     (what every gate returns)
    noise.py         where a gate's noise comes from (the global RNG, or the global token index)
    noisy_topk.py    Shazeer et al. §2.1: noisy top-k, importance and load CV² losses
    gating_ops.py    the noisy gate's [tokens, experts] arithmetic as one memory-lean autograd function
    hierarchical.py  App. B: a primary gate over groups, a secondary gate inside each chosen group
    batchwise.py     App. F: strictly balanced batchwise gating with learned thresholds
    softmax_topk.py  MoA: softmax over experts, top-k, switch-style load loss and router z-loss
    aux_free.py      DeepSeek-V3: top-k of scores + per-expert biases that follow the load, no CV² loss
    node_limited.py  DeepSeek-V3's node-limited top-k: each token's experts from its M best of G expert groups
    build.py         the router a config asks for (--gate), and GATES: every gate by name
"""

from moe_scale.moe.router.aux_free import AuxFreeRouter
from moe_scale.moe.router.base import GATE_OWNS, Router, RouterOutput, gating_precision
from moe_scale.moe.router.batchwise import BatchwiseRouter
from moe_scale.moe.router.build import GATES, build_router, gate_class
from moe_scale.moe.router.hierarchical import HierarchicalRouter
from moe_scale.moe.router.node_limited import NodeLimitedRouter
from moe_scale.moe.router.noise import GlobalTokenNoise, NoiseSampler, sample_noise
from moe_scale.moe.router.noisy_topk import NoisyTopKRouter, prob_in_top_k
from moe_scale.moe.router.softmax_topk import SoftmaxTopKRouter

__all__ = ["AuxFreeRouter", "BatchwiseRouter", "GATES", "GATE_OWNS", "GlobalTokenNoise", "HierarchicalRouter",
           "NodeLimitedRouter", "NoiseSampler",
           "NoisyTopKRouter", "Router", "RouterOutput", "SoftmaxTopKRouter", "build_router", "gating_precision",
           "gate_class", "prob_in_top_k", "sample_noise"]
