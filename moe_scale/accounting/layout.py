"""A layout: how one model trains on a cluster (nodes x GPUs per node, expert-parallel size, ZeRO stage, expert
optimizer, precision, expert recompute, flat or hierarchical all-to-all), and the check that `train` accepts it.

`checked_config` applies a layout to the user's config and DeepSpeed JSON and runs `train`'s own checks
(layout/checks.py: the config, the DeepSpeed JSON with the optimizer under it, --ep-size against the processes,
the hierarchical all-to-all against the nodes, the batch against the processes): a layout that `train` would
refuse raises its UserError here, so the planner never reports one as fitting.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from moe_scale.config import RunConfig
from moe_scale.errors import UserError
from moe_scale.layout.checks import check_layout

PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Layout:
    nodes: int
    gpus_per_node: int
    ep_size: int = 1
    zero_stage: int = 0
    optimizer: str = "adam"         # the expert optimizer: adam, or factored (App. D)
    precision: str = "fp32"
    recompute: bool = False         # --expert-recompute
    all_to_all: str = "flat"        # --all-to-all
    etp_size: int = 1               # --etp-size: each expert's hidden units over this many ranks

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def expert_ranks(self) -> int:
        """The ranks one copy of every expert spans: ep x etp (the exchange's group)."""
        return self.ep_size * self.etp_size

    @property
    def expert_data_parallel(self) -> int:
        return self.world // self.expert_ranks

    def describe(self) -> str:
        return (f"{self.nodes} node(s) x {self.gpus_per_node}, ep {self.ep_size}"
                f"{f', etp {self.etp_size}' if self.etp_size > 1 else ''}, ZeRO-{self.zero_stage}, "
                f"{self.optimizer}, {self.precision}{', recompute' if self.recompute else ''}, "
                f"{self.all_to_all} all-to-all")


def ds_config_for(base: dict, layout: Layout) -> dict:
    """The DeepSpeed JSON `train` would get: the user's (or the built-in one) with this ZeRO stage and precision."""
    ds = copy.deepcopy(base)
    ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": layout.zero_stage}
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": layout.precision == "bf16"}
    return ds


def batch_sequences(config: RunConfig, layout: Layout, batch_tokens: int | None) -> int:
    """The global batch in sequences: the config's, or `batch_tokens` rounded to a multiple of the processes x
    --grad-accum (what `train` needs), at least one sequence per process."""
    if batch_tokens is None:
        return config.train.batch_size
    per_step = layout.world * config.train.grad_accum
    return max(1, round(batch_tokens / config.data.seq_len / per_step)) * per_step


def checked_config(config: RunConfig, base_ds: dict, layout: Layout, batch_tokens: int | None) -> RunConfig:
    """`config` with the layout applied, after `train`'s checks of it (UserError if train refuses it)."""
    if layout.nodes < 1 or layout.gpus_per_node < 1:
        raise UserError(f"--nodes {layout.nodes} --gpus-per-node {layout.gpus_per_node}: both must be at least 1")
    if layout.precision not in PRECISIONS:
        raise UserError(f"--precision {layout.precision}: the planner counts fp32 or bf16")
    planned = copy.deepcopy(config)
    planned.parallel.ep_size = layout.ep_size
    if planned.has_moe_ffn:
        planned.moe.experts.tensor_parallel = layout.etp_size
    planned.train.batch_size = batch_sequences(config, layout, batch_tokens)
    planned.train.optimizer = layout.optimizer
    if planned.has_moe_ffn:
        planned.moe.experts.recompute = layout.recompute
        planned.moe.dispatch.all_to_all = layout.all_to_all
        if layout.all_to_all == "hierarchical":
            node_size = planned.moe.dispatch.node_size
            if node_size and node_size != layout.gpus_per_node:
                raise UserError(f"--node-size {node_size} differs from --gpus-per-node {layout.gpus_per_node}; the "
                                f"planner's nodes are --gpus-per-node ranks each: drop --node-size")
            planned.moe.dispatch.node_size = layout.gpus_per_node
    source = f"--zero {layout.zero_stage} --precision {layout.precision}"
    check_layout(planned, ds_config_for(base_ds, layout), source, layout.world, lambda: layout.gpus_per_node)
    return planned
