"""The planner: one model (any config `train` can build) on a cluster of one GPU type, one layout at a time.

`Planner.plan(layout)` checks the layout with `train`'s own checks (accounting/layout.py), then predicts the
memory of one GPU (accounting/memory.py) and the time of one step (accounting/step_time.py). `smallest_fitting`
walks the node counts up from 1 until a layout fits. The default expert-parallel size on W GPUs (when --ep-size
is not given) is the largest that divides W and every expert-parallel layer's units (experts; the hierarchical
gate's groups; MoA's attention experts): experts spread as far as the cluster allows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moe_scale.accounting.gpus import GPU
from moe_scale.accounting.layout import Layout, batch_sequences, checked_config, ds_config_for
from moe_scale.accounting.memory import DEFAULT_DROPLESS_LOAD, DEFAULT_MARGIN, memory
from moe_scale.accounting.model_shape import PlannedModel
from moe_scale.accounting.step_time import step_time
from moe_scale.errors import UserError

MAX_NODES = 4096


@dataclass(frozen=True)
class Planner:
    model: PlannedModel
    gpu: GPU
    base_ds: dict                        # the user's DeepSpeed JSON (or the built-in one)
    batch_tokens: int | None = None      # None: the config's --batch-size x --seq-len
    inter_gbs: float | None = None       # None: the GPU type's default
    efficiency: float | None = None      # None: the GPU type's
    margin: float = DEFAULT_MARGIN
    dropless_load: float = DEFAULT_DROPLESS_LOAD
    name: str = "custom"

    def default_ep(self, world: int) -> int:
        """The largest expert-parallel size dividing the GPUs and every expert-parallel layer's units."""
        return math.gcd(world, *self.model.sharded_units) if self.model.expert_layers else 1

    def plan(self, layout: Layout) -> dict:
        """The layout's memory and step time; UserError if `train` would refuse it."""
        config = checked_config(self.model.config, self.base_ds, layout, self.batch_tokens)
        tokens = config.train.batch_size * config.data.seq_len
        ds = ds_config_for(self.base_ds, layout)
        mem = memory(self.model, layout, self.gpu, tokens, ds, self.margin, self.dropless_load)
        time = step_time(self.model, layout, self.gpu, tokens, ds, self.inter_gbs, self.efficiency)
        experts = config.moe.experts.num_experts if config.has_moe_ffn else 0
        return {"preset": self.name, "gpu": self.gpu.name, "nodes": layout.nodes,
                "gpus_per_node": layout.gpus_per_node, "world": layout.world, "ep_size": layout.ep_size,
                "experts_per_gpu": experts // layout.ep_size, "zero_stage": layout.zero_stage,
                "optimizer": layout.optimizer, "precision": layout.precision, "recompute": layout.recompute,
                "all_to_all": layout.all_to_all,
                "force_balanced_routing": bool(config.has_moe_ffn and config.moe.router.force_balanced_routing),
                "batch_sequences": config.train.batch_size,
                "tokens_per_step": tokens, "tokens_per_gpu": tokens / layout.world,
                "params_total": self.model.total_params,
                "params_per_gpu": round(self.model.params_per_gpu(layout.ep_size, layout.world)),
                "flops_per_token": self.model.flops_per_token, **mem, "time": time,
                "tokens_per_s": time["tokens_per_s"], "tflops_per_gpu": time["tflops_per_gpu"], "mfu": time["mfu"]}

    def with_nodes(self, layout: Layout, nodes: int, ep_fixed: bool) -> Layout:
        world = nodes * layout.gpus_per_node
        return dataclasses.replace(layout, nodes=nodes, ep_size=layout.ep_size if ep_fixed else self.default_ep(world))

    def smallest_fitting(self, layout: Layout, ep_fixed: bool, max_nodes: int = MAX_NODES) -> dict | None:
        """The plan on the fewest nodes (the layout otherwise as given) that `train` accepts and that fits."""
        for nodes in range(1, max_nodes + 1):
            candidate = self.with_nodes(layout, nodes, ep_fixed)
            if not self.fits(candidate):
                continue        # cheap: memory alone, before train's checks
            try:
                result = self.plan(candidate)
            except UserError:
                continue        # e.g. a GPU count that --ep-size or the batch does not divide
            if result["fits"]:
                return result
        return None

    def fits(self, layout: Layout) -> bool:
        """Whether the layout's memory fits (no checks: `plan` makes them)."""
        if layout.world % layout.ep_size:
            return False
        tokens = batch_sequences(self.model.config, layout, self.batch_tokens) * self.model.config.data.seq_len
        return memory(self.model, layout, self.gpu, tokens, ds_config_for(self.base_ds, layout), self.margin,
                      self.dropless_load)["fits"]
