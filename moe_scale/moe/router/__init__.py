"""Routers (gates): which experts each token goes to, with which weights, and the balancing losses.

    base.py          Router (the base every gate derives from) and RouterOutput (what every gate returns)
    noisy_topk.py    Shazeer et al. §2.1: noisy top-k, importance and load CV² losses
    gating_ops.py    the noisy gate's [tokens, experts] arithmetic as one memory-lean autograd function
    hierarchical.py  App. B: a primary gate over groups, a secondary gate inside each chosen group
    batchwise.py     App. F: strictly balanced batchwise gating with learned thresholds
    softmax_topk.py  MoA: softmax over experts, top-k, switch-style load loss and router z-loss
    build.py         the router a config asks for (--gate)
"""

from moe_scale.moe.router.base import GlobalTokenNoise, NoiseSampler, Router, RouterOutput, sample_noise
from moe_scale.moe.router.batchwise import BatchwiseRouter
from moe_scale.moe.router.build import build_router
from moe_scale.moe.router.hierarchical import HierarchicalRouter
from moe_scale.moe.router.noisy_topk import NoisyTopKRouter, prob_in_top_k
from moe_scale.moe.router.softmax_topk import SoftmaxTopKRouter

__all__ = ["BatchwiseRouter", "GlobalTokenNoise", "HierarchicalRouter", "NoiseSampler", "NoisyTopKRouter", "Router",
           "RouterOutput", "SoftmaxTopKRouter", "build_router", "prob_in_top_k", "sample_noise"]
