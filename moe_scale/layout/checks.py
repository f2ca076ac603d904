"""How a run is laid out over processes: the checks `moe-scale train` and `moe-scale plan` share.

A layout is the config (model, --ep-size, --optimizer, --all-to-all, batch) with a DeepSpeed JSON (ZeRO stage,
precision) on a number of processes, so many per node. `train` checks it before it touches anything; the
planner checks every layout it reports with the same functions, so a layout `train` refuses is never planned.
"""

from __future__ import annotations

from collections.abc import Callable

from moe_scale.config import RunConfig
from moe_scale.errors import UserError
from moe_scale.layout.ds_config import validate_ds_config, zero_stage


def check_run_layout(config: RunConfig, ds_config: dict, ds_source: str) -> None:
    """What does not depend on the number of processes: the DeepSpeed JSON, and the optimizer under it."""
    validate_ds_config(ds_config, ds_source)
    check_optimizer_fits(config.train, ds_config, ds_source)


def check_world_layout(config: RunConfig, world: int, ranks_per_node: Callable[[], int]) -> int:
    """What does: --ep-size against the processes, the hierarchical all-to-all against the nodes, the batch.
    `ranks_per_node()` is asked only where it matters (a hierarchical all-to-all over several ranks).
    Returns the micro-batch (sequences per rank per micro-step)."""
    t, ep_size, dispatch = config.train, config.expert_ranks, config.moe.dispatch
    if world % ep_size and ep_size != config.parallel.ep_size:
        raise UserError(f"--ep-size {config.parallel.ep_size} x --etp-size {ep_size // config.parallel.ep_size} = "
                        f"{ep_size} does not divide the {world} processes (each copy of the experts spans that "
                        f"many); launch a multiple of {ep_size} processes or change --ep-size or --etp-size")
    if world % ep_size:
        raise UserError(f"--ep-size {ep_size} does not divide the {world} processes (the processes split into "
                        f"expert-parallel groups of --ep-size each); launch a multiple of {ep_size} processes or "
                        f"change --ep-size")
    if dispatch.all_to_all == "hierarchical" and ep_size > 1:
        _check_node_layout(ep_size, ranks_per_node)
    per_step = world * t.grad_accum
    if t.batch_size % per_step:
        raise UserError(f"--batch-size {t.batch_size} is not divisible by processes x --grad-accum = {per_step} "
                        f"(every process takes the same whole number of sequences in each micro-batch); use a "
                        f"multiple of {per_step}")
    return t.batch_size // per_step


def check_layout(config: RunConfig, ds_config: dict, ds_source: str, world: int,
                 ranks_per_node: Callable[[], int]) -> int:
    """Every check above, after the config's own (`RunConfig.validate`); returns the micro-batch."""
    config.validate()
    check_run_layout(config, ds_config, ds_source)
    return check_world_layout(config, world, ranks_per_node)


def _check_node_layout(ep_size: int, ranks_per_node: Callable[[], int]) -> None:
    try:
        per_node = ranks_per_node()
    except ValueError as e:
        raise UserError(str(e)) from None
    if ep_size % per_node and per_node % ep_size:
        raise UserError(f"--all-to-all hierarchical: {per_node} ranks per node and --ep-size {ep_size} must divide "
                        f"one another (an expert-parallel group is whole nodes, or lies inside one); "
                        f"set --node-size or --ep-size accordingly")


def check_optimizer_fits(train, ds_config: dict, source: str) -> None:
    """Refuses the DeepSpeed configs under which the factored optimizer would silently not factor."""
    if train.optimizer != "factored":
        return
    half = [k for k in ("bf16", "fp16") if ds_config.get(k, {}).get("enabled")]
    if zero_stage(ds_config) > 0 or half:
        what = f"ZeRO stage {zero_stage(ds_config)}" if zero_stage(ds_config) > 0 else f"{half[0]} enabled"
        raise UserError(f"{source} has {what}, under which --optimizer factored cannot factor the expert "
                        "matrices: DeepSpeed then flattens parameters into 1-D partitions, and the factored second "
                        "moment needs each expert matrix whole; use a stage-0 fp32 config (e.g. "
                        "ds_configs/cpu.json) with --optimizer factored, or --optimizer adam")
