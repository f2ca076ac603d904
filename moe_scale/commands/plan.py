"""`moe-scale plan`: memory, step time and throughput of any model `train` can build, on a cluster of GPUs.

The model: the same flags and --config as `moe-scale train` (or --preset), built on the meta device. The cluster:
--gpu (accounting/gpus.py), --gpus-per-node, --nodes (a count, a comma-separated list for --search/--plot, or
`auto`: the smallest that fits), --inter-node-gbs. The layout: --ep-size, --optimizer, --expert-recompute and
--all-to-all as for train, the ZeRO stage and precision from --ds-config (or --zero, --precision); --ep-size
defaults to the largest that divides the GPUs and the experts, with --config too (a run's own --ep-size is kept
only when given again here). --search ranks every layout that fits by predicted tokens/s; --plot FILE draws memory
and step time against the nodes; --tokens N adds the wall time and GPU-hours of training on N tokens. Where more
nodes predict fewer tokens/s than the smallest count that fits, a remark says why and how much to grow the batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from moe_scale.accounting.gpus import GPUS, get_gpu
from moe_scale.accounting.layout import PRECISIONS, Layout
from moe_scale.accounting.memory import DEFAULT_DROPLESS_LOAD, DEFAULT_MARGIN
from moe_scale.accounting.plan import MAX_NODES, Planner
from moe_scale.accounting.units import parse_count
from moe_scale.commands.help_format import HelpFormatter
from moe_scale.commands.config_flags import DEST, add_config_flags, config_from_args, given_settings
from moe_scale.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="memory, step time and tokens/s of a model on a GPU cluster; search layouts",
                       description="Plan any model `moe-scale train` can build (its flags, --config or --preset) on a "
                                   "cluster: memory per GPU with reserves and a margin, predicted step time, "
                                   "tokens/s, TFLOPS/GPU and MFU; --search ranks the layouts that fit.",
                       formatter_class=HelpFormatter)
    cluster = p.add_argument_group("cluster and layout")
    cluster.add_argument("--gpu", default="h100-sxm", help=f"GPU type: {', '.join(GPUS)}")
    cluster.add_argument("--gpus-per-node", type=int, default=None, help="default: the GPU type's usual server")
    cluster.add_argument("--nodes", default="auto", help="nodes; a comma-separated list (--search, --plot); or auto: "
                                                         "the smallest count that fits")
    cluster.add_argument("--inter-node-gbs", type=float, default=None, metavar="GBS",
                         help="network bandwidth per GPU and direction between nodes, GB/s (default: the GPU type's)")
    cluster.add_argument("--gpu-mem", type=float, default=None, metavar="GIB",
                         help="memory of one GPU in GiB (default: the GPU type's)")
    cluster.add_argument("--zero", type=int, default=None, metavar="STAGE",
                         help="DeepSpeed ZeRO stage (default: --ds-config's, or 0 without one)")
    cluster.add_argument("--precision", choices=PRECISIONS, default=None,
                         help="default: bf16 if --ds-config enables it, else fp32")
    cluster.add_argument("--batch-tokens", type=int, default=None,
                         help="tokens per global batch (default: a preset's paper batch, else --batch-size x "
                              "--seq-len); rounded to whole sequences on every GPU")
    cluster.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="share of GPU memory left free")
    cluster.add_argument("--efficiency", type=float, default=None,
                         help="share of the dense peak the model's FLOPs run at (default: the GPU type's)")
    cluster.add_argument("--dropless-load", type=float, default=DEFAULT_DROPLESS_LOAD,
                         help="dropless dispatch: the most a rank receives, x the balanced load (memory)")
    cluster.add_argument("--tokens", default=None, metavar="N",
                         help="training tokens (e.g. 300000000, 100M, 1.5B, 2T): adds the wall time, the steps and "
                              "the GPU-hours of training on them at the predicted tokens/s")
    cluster.add_argument("--search", action="store_true", help="rank the layouts that fit by tokens/s")
    cluster.add_argument("--top", type=int, default=10, help="--search: layouts shown")
    cluster.add_argument("--json", action="store_true", help="print one JSON object")
    cluster.add_argument("--plot", metavar="FILE", help="write memory and step time against nodes (PNG)")
    p.add_argument("--config", metavar="FILE", help="a saved config.json (or a run directory); flags given here "
                                                     "override it")
    add_config_flags(p, leave_out=("run",), unlisted=("resume",))   # plan makes no run directory
    p.set_defaults(run_command=run, computes=False)   # (counts and models: its threads go unsaid)


def run(args: argparse.Namespace) -> None:
    print(run_plan(args))


def _nodes(text: str) -> list[int] | None:
    """None for auto, else the node counts."""
    if text.strip().lower() == "auto":
        return None
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = [0]
    if not counts or min(counts) < 1 or max(counts) > MAX_NODES:
        raise UserError(f"--nodes {text}: give a node count from 1 to {MAX_NODES}, a comma-separated list of them, "
                        f"or auto (the smallest that fits)")
    return sorted(set(counts))


def _check_numbers(args: argparse.Namespace) -> None:
    checks = [(args.gpus_per_node is not None and args.gpus_per_node < 1, "--gpus-per-node",
               "at least 1"),
              (args.inter_node_gbs is not None and not 0 < args.inter_node_gbs < math.inf, "--inter-node-gbs",
               "a positive finite bandwidth (GB/s, e.g. 50)"),
              (args.gpu_mem is not None and not 0 < args.gpu_mem < math.inf, "--gpu-mem",
               "a positive finite size (GiB, e.g. 80)"),
              (not 0 <= args.margin < 1, "--margin", "in [0, 1), e.g. 0.05"),
              (args.efficiency is not None and not 0 < args.efficiency <= 1, "--efficiency", "in (0, 1]"),
              (not args.dropless_load >= 1, "--dropless-load", "at least 1 (the balanced load)"),
              (args.batch_tokens is not None and args.batch_tokens < 1, "--batch-tokens", "at least 1"),
              (args.top < 1, "--top", "at least 1")]
    for bad, flag, what in checks:
        if bad:
            raise UserError(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}: must be {what}")
    if args.plot:
        plot = Path(args.plot)
        if plot.is_dir() or not plot.parent.is_dir():
            raise UserError(f"--plot {plot}: give a file in an existing directory, e.g. plan.png")
        if not os.access(plot.parent, os.W_OK) or plot.exists() and not os.access(plot, os.W_OK):
            raise UserError(f"--plot {plot}: this directory or file is not writable; give a file where you may "
                            f"write, e.g. /tmp/plan.png")


def planner_from_args(args: argparse.Namespace) -> tuple[Planner, Layout, bool]:
    """(the planner, the layout the flags describe on 1 node, whether --ep-size was given)."""
    from moe_scale.accounting.model_shape import planned_model
    from moe_scale.accounting.presets import get_preset
    from moe_scale.layout.ds_config import load_ds_config, zero_stage

    _check_numbers(args)
    given = set(given_settings(args))
    if "resume" in given:
        raise UserError("plan takes no --resume; pass the run directory as --config RUN_DIR")
    preset = get_preset(getattr(args, DEST + "preset")) if "preset" in given else None
    config = config_from_args(args)
    batch_tokens = args.batch_tokens
    if preset is not None and batch_tokens is None and preset.batch_words and "batch_size" not in given:
        batch_tokens = preset.batch_words
    config.validate()
    gpu = get_gpu(args.gpu).with_memory(args.gpu_mem)
    base_ds = load_ds_config(config.parallel.ds_config)
    zero = zero_stage(base_ds) if args.zero is None else args.zero
    if zero not in (0, 1, 2, 3):
        raise UserError(f"--zero {zero}: ZeRO stages are 0, 1 and 2 (3 cannot shard MoE layers)")
    precision = args.precision or ("bf16" if base_ds.get("bf16", {}).get("enabled") else "fp32")
    gpu.peak_tflops(precision)   # a GPU without bf16 refuses it here
    name = preset.name if preset is not None else "custom"
    planner = Planner(planned_model(config), gpu, base_ds, batch_tokens, args.inter_node_gbs, args.efficiency,
                      args.margin, args.dropless_load, name)
    layout = Layout(1, args.gpus_per_node or gpu.gpus_per_node, config.parallel.ep_size, zero,
                    config.train.optimizer, precision, config.moe.experts.recompute, config.moe.dispatch.all_to_all,
                    config.etp_size)
    return planner, layout, "ep_size" in given


def run_plan(args: argparse.Namespace) -> str:
    nodes = _nodes(args.nodes)
    if nodes is not None and len(nodes) > 1 and not (args.search or args.plot):
        raise UserError(f"--nodes {args.nodes}: a list of node counts is for --search or --plot; plan one count "
                        f"(or auto) without them")
    from moe_scale.accounting.plan import fewer_nodes_remark, training

    tokens = None if args.tokens is None else parse_count(args.tokens, "--tokens")
    planner, layout, ep_fixed = planner_from_args(args)
    smallest = planner.smallest_fitting(layout, ep_fixed)
    planned = planner.with_nodes(layout, 1 if nodes is None else nodes[0], ep_fixed)
    if nodes is None and smallest is not None:
        result, planned = smallest, planner.with_nodes(layout, smallest["nodes"], ep_fixed)
    else:
        result = planner.plan(planned)
    result["smallest_fitting"] = None if smallest is None else {
        "nodes": smallest["nodes"], "world": smallest["world"], "total_bytes": smallest["bytes"]["total"]}
    result["ep_size_reason"] = _ep_reason(planner, layout, result, ep_fixed, bool(args.config))
    remark = None if smallest is None else fewer_nodes_remark(
        planner, planned, result, smallest, planner.with_nodes(layout, smallest["nodes"], ep_fixed))
    result["remarks"] = [] if remark is None else [remark["text"]]
    if remark is not None:
        result["fewer_nodes"] = remark
    if tokens is not None:
        result["training"] = training(result, tokens)
    found = None
    if args.search:
        from moe_scale.accounting.layout_search import search

        found = search(planner, layout, nodes or _auto_nodes(smallest))
        ranked = found["ranked"][:args.top]
        if tokens is not None:
            ranked = [{**r, "training": training(r, tokens)} for r in ranked]
        result["search"] = {**found, "ranked": ranked}
    if args.plot:
        _plot(planner, layout, ep_fixed, nodes or sorted({r["nodes"] for r in (found or {}).get("ranked", [])})
              or _auto_nodes(smallest), Path(args.plot))
        result["plot"] = args.plot
    if args.json:   # strict JSON: a number no finite value stands for (a layout that never fits) is null
        return json.dumps(_finite(result), allow_nan=False)
    from moe_scale.commands.plan_report import format_plan, format_search

    text = format_plan(result, smallest)
    return text + ("\n" + format_search(result["search"]) if args.search else "")


def _ep_reason(planner: Planner, layout: Layout, result: dict, ep_fixed: bool, from_config: bool) -> str:
    """Why the plan has its expert-parallel size."""
    ep = result["ep_size"]
    if ep_fixed:
        return f"ep {ep}: --ep-size given"
    if not planner.model.expert_layers:
        return "ep 1: the model has no expert-parallel layer"
    units = sorted(set(planner.model.sharded_units))
    what = f"the {units[0]:,} experts" if len(units) == 1 else f"every expert-parallel layer's units ({units})"
    kept = (f"; --config's run had --ep-size {layout.ep_size}: pass --ep-size {layout.ep_size} to plan that"
            if from_config and layout.ep_size != ep else "")
    return f"ep {ep}: the default, the largest that divides the {result['world']:,} GPUs and {what}{kept}"


def _auto_nodes(smallest: dict | None) -> list[int]:
    """Powers of two from 1 up to 4 x the smallest count that fits (at least 16)."""
    top = min(MAX_NODES, max(16, 4 * (smallest["nodes"] if smallest else MAX_NODES // 4)))
    return [2 ** i for i in range(top.bit_length()) if 2 ** i <= top]


def _finite(value):
    """`value` with every infinite or NaN float replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _plot(planner: Planner, layout: Layout, ep_fixed: bool, nodes: list[int], path: Path) -> None:
    from moe_scale.accounting.plan_plot import write_plot

    plans = []
    for n in nodes:
        try:
            plans.append(planner.plan(planner.with_nodes(layout, n, ep_fixed)))
        except UserError:
            continue
    if not plans:
        raise UserError(f"--plot: train accepts this layout on none of {nodes} node(s); give --nodes it accepts")
    ep = f"ep {layout.ep_size}" if ep_fixed else "the largest ep"
    title = (f"{planner.name} on {planner.gpu.name} x {layout.gpus_per_node} per node: {ep}, ZeRO-{layout.zero_stage}, "
             f"{layout.optimizer}, {layout.precision}, {layout.all_to_all} all-to-all"
             f"{', recompute' if layout.recompute else ''}")
    try:
        write_plot(plans, path, title)
    except OSError as e:   # a read-only file system, a full disk
        raise UserError(f"--plot {path}: not written ({e.strerror or e}); give a file where you may write") from None
