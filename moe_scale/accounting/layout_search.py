"""Search the layouts of one model on one GPU type and rank those that fit by predicted tokens/s.

Axes: nodes (the given counts), expert-parallel size (every size dividing the GPUs and the expert-parallel
layers' units), ZeRO stage (0, 1, 2), expert optimizer (adam, factored), expert recompute (off, on) and the
all-to-all (flat, hierarchical); an axis a model does not have (no MoE layer: no optimizer choice for experts, no
recompute, no all-to-all) is left at its value. The precision is the user's. Each layout is checked with
`train`'s own checks (those it refuses are counted by train's whole message, which says what is wrong and why,
never ranked) and must fit with the planner's margin (for those that do not, the least memory any of them needs
is reported against the usable memory).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

from moe_scale.accounting.layout import Layout
from moe_scale.accounting.plan import Planner
from moe_scale.errors import UserError


def expert_parallel_sizes(planner: Planner, world: int) -> list[int]:
    largest = planner.default_ep(world)
    return [p for p in range(1, largest + 1) if largest % p == 0]


def candidate_layouts(planner: Planner, base: Layout, nodes: list[int]) -> list[Layout]:
    config = planner.model.config
    moe = config.has_moe_ffn
    optimizers = ("adam", "factored") if moe else (base.optimizer,)
    recomputes = (False, True) if moe else (base.recompute,)
    exchanges = ("flat", "hierarchical") if moe else (base.all_to_all,)
    layouts = []
    for n in nodes:
        world = n * base.gpus_per_node
        for ep, etp, zero, optimizer, recompute, exchange in itertools.product(
                expert_parallel_sizes(planner, world), tensor_parallel_sizes(config), (0, 1, 2), optimizers,
                recomputes, exchanges):
            if exchange == "hierarchical" and ep * etp == 1 or world % (ep * etp):
                continue     # nothing to exchange (the same layout as flat), or more expert ranks than GPUs fit
            layouts.append(dataclasses.replace(base, nodes=n, ep_size=ep, etp_size=etp, zero_stage=zero,
                                               optimizer=optimizer, recompute=recompute, all_to_all=exchange))
    return layouts


def tensor_parallel_sizes(config) -> list[int]:
    """--etp-size values worth trying: 1, 2, 4 and 8 where they divide an expert's hidden units (an MoE layer's
    experts only: MoA's attention experts are never split)."""
    experts = config.moe.experts
    if not config.has_moe_ffn or config.model.kind == "transformer" and config.attention.kind == "moa":
        return [experts.tensor_parallel]
    return [t for t in (1, 2, 4, 8) if experts.hidden % t == 0]


def search(planner: Planner, base: Layout, nodes: list[int]) -> dict:
    """{"ranked": plans that fit, fastest first; "refused": why train refused the others (its message: what is
    wrong and why), by reason; "too_large": layouts train accepts that do not fit, "too_large_least": the one of
    them needing the least memory ({"bytes", "usable_bytes", "gpu_mem_bytes", "margin", "layout"}; None if none);
    "considered": all layouts}."""
    ranked, refused, too_large, least = [], Counter(), 0, None
    layouts = candidate_layouts(planner, base, nodes)
    for layout in layouts:
        try:
            result = planner.plan(layout)
        except UserError as e:
            refused[str(e)] += 1
            continue
        if result["fits"]:
            ranked.append(result)
            continue
        too_large += 1
        if least is None or result["bytes"]["total"] < least["bytes"]:
            least = {"bytes": result["bytes"]["total"], "usable_bytes": result["usable_bytes"],
                     "gpu_mem_bytes": result["gpu_mem_bytes"], "margin": result["margin"], "layout": layout.describe()}
    ranked.sort(key=lambda r: (-r["tokens_per_s"], r["world"], r["bytes"]["total"]))
    return {"ranked": ranked, "refused": dict(refused), "too_large": too_large, "too_large_least": least,
            "considered": len(layouts)}
