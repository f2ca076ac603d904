"""`moe-scale plan --preset NAME --nodes N --gpus-per-node G --gpu-mem GiB --zero STAGE [--optimizer ...]`."""

from __future__ import annotations

import argparse
import json

from moe_scale.accounting.plan import GIB, MAX_NODES, OPTIMIZERS, PRECISIONS, Cluster, plan, smallest_fitting
from moe_scale.commands.help_format import HelpFormatter


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="per-GPU memory of a preset on a cluster, and the smallest cluster that fits",
                       description="Per-GPU memory (parameters, gradients, optimizer state, activations) of an "
                                   "LSTM preset on a cluster under moe_scale's expert-parallel and ZeRO layout, "
                                   "whether it fits, and the smallest number of nodes that does.",
                       formatter_class=HelpFormatter)
    p.add_argument("--preset", required=True, help="an LSTM preset (`moe-scale flops --list`)")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the cluster")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    p.add_argument("--gpu-mem", type=float, default=80.0, metavar="GIB", help="memory of one GPU in GiB")
    p.add_argument("--zero", type=int, default=2, metavar="STAGE", help="DeepSpeed ZeRO stage (0, 1, 2)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="expert optimizer: Adam, or App. D's β1=0 factored second moment")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="bf16: 2-byte weights and gradients beside fp32 master weights")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="tokens per global batch (default: the paper's batch for the preset)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run_command=run)


def run(args: argparse.Namespace) -> None:
    print(run_plan(args))


def run_plan(args: argparse.Namespace) -> str:
    cluster = Cluster(args.nodes, args.gpus_per_node, args.gpu_mem, args.zero, args.optimizer, args.precision)
    result = plan(args.preset, cluster, args.batch_tokens)
    smallest = smallest_fitting(args.preset, cluster, args.batch_tokens)
    result["smallest_fitting"] = None if smallest is None else {
        "nodes": smallest["nodes"], "world": smallest["world"], "total_bytes": smallest["bytes"]["total"]}
    if args.json:
        return json.dumps(result)
    gib = {k: v / GIB for k, v in result["bytes"].items()}
    lines = [f"{result['preset']} on {result['nodes']} node(s) x {result['gpus_per_node']} GPU(s) "
             f"({result['world']} GPUs, {args.gpu_mem:g} GiB each), ZeRO-{result['zero_stage']}, "
             f"{result['optimizer']} expert optimizer, {result['precision']}",
             f"  expert parallel size {result['ep_size']}, {result['experts_per_gpu']} experts and "
             f"{result['params_per_gpu'] / 1e6:.1f}M parameters per GPU, {result['tokens_per_gpu']:.0f} tokens per GPU",
             *(f"  {name:<16} {value:8.2f} GiB" for name, value in gib.items()),
             f"  {'fits' if result['fits'] else 'does NOT fit'} in {args.gpu_mem:g} GiB"]
    if smallest is None:
        lines.append(f"  no cluster of up to {MAX_NODES} nodes x {args.gpus_per_node} GPUs fits")
    else:
        lines.append(f"  smallest that fits: {smallest['nodes']} node(s) x {args.gpus_per_node} = "
                     f"{smallest['world']} GPUs ({smallest['bytes']['total'] / GIB:.2f} GiB per GPU)")
    return "\n".join(lines)
