#!/usr/bin/env python
"""The planner's predicted TFLOPS/GPU for Shazeer et al.'s Table 7 and Table 8 models on K40 clusters, beside the
TFLOPS/GPU the paper measured.

Each preset on its paper cluster (16 K40s for Table 7; 32 for Table 8, 64 and 128 for its two largest models), the
paper's batch (300,000 words; 2.5 million), the paper's sampled softmax (8192 samples) and expert optimizer (Adam;
Table 8: App. D's factored one, with expert recompute), ZeRO-0 and fp32 (what `train` accepts with the factored
optimizer, and what a K40 has), experts spread as far as the GPUs allow, flat all-to-all; the batch of a step in
as few micro-batches (--grad-accum 1, 2, 4, 8, 16) as fit a K40's memory (1 where none does). The K40's constants
are the planner's table (accounting/gpus.py); nothing here is tuned to the paper's numbers.

    python tools/plan_paper.py                                  # 4 K40s per node, the table's 1.25 GB/s network
    python tools/plan_paper.py --gpus-per-node 8 --inter-node-gbs 5 --out paper.json

Prints a Markdown table; --out also writes the rows as JSON. Exit status 0; 2 a bad flag.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tool_args import OneLineParser, check_out_file, positive_float, positive_int

REPO = Path(__file__).resolve().parents[1]
GRAD_ACCUMS = (1, 2, 4, 8, 16)   # micro-batches per step tried, fewest first, until the model fits a K40
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str]):
    parser = OneLineParser(prog="plan_paper.py", description=__doc__.split("\n")[0])
    parser.add_argument("--gpus-per-node", type=positive_int, default=4)
    parser.add_argument("--inter-node-gbs", type=positive_float, default=None, help="default: the K40 table's")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    check_out_file(parser, args.out)
    return args


def _planned_row(preset, gpus_per_node: int, inter_node_gbs: float | None, grad_accum: int) -> dict:
    from moe_scale.accounting.gpus import get_gpu
    from moe_scale.accounting.layout import Layout
    from moe_scale.accounting.model_shape import planned_model
    from moe_scale.accounting.plan import Planner
    from moe_scale.accounting.presets import preset_config
    from moe_scale.layout.ds_config import DEFAULT_DS_CONFIG

    config = preset_config(preset.name)
    config.softmax.kind, config.softmax.num_sampled = preset.softmax.kind, preset.softmax.num_samples
    config.train.optimizer, config.train.grad_accum = preset.optimizer, grad_accum
    planner = Planner(planned_model(config), get_gpu("k40"), DEFAULT_DS_CONFIG, preset.batch_words,
                      inter_node_gbs, name=preset.name)
    per_node = min(gpus_per_node, preset.cluster_gpus)
    nodes = preset.cluster_gpus // per_node
    layout = Layout(nodes, per_node, planner.default_ep(preset.cluster_gpus), 0, preset.optimizer, "fp32",
                    config.moe.experts.recompute if config.has_moe_ffn else False)
    result = planner.plan(layout)
    seconds = result["time"]["seconds"]
    return {"preset": preset.name, "gpus": preset.cluster_gpus, "gpus_per_node": per_node,
            "batch_tokens": result["tokens_per_step"], "grad_accum": grad_accum,
            "paper_tflops_per_gpu": preset.paper.tflops_per_gpu,
            "predicted_tflops_per_gpu": result["tflops_per_gpu"],
            "predicted_over_paper": result["tflops_per_gpu"] / preset.paper.tflops_per_gpu,
            "step_s": seconds["step"], "parts_s": seconds, "fits_k40": result["fits"],
            "gib_per_gpu": result["bytes"]["total"] / 2**30}


def paper_rows(gpus_per_node: int, inter_node_gbs: float | None) -> list[dict]:
    from moe_scale.accounting.presets import PRESETS

    rows = []
    for preset in PRESETS.values():
        if preset.kind != "lstm" or preset.paper is None:
            continue
        for grad_accum in GRAD_ACCUMS:   # the paper's batch per step, in as few micro-batches as fit
            row = _planned_row(preset, gpus_per_node, inter_node_gbs, grad_accum)
            if row["fits_k40"]:
                break
        rows.append(row if row["fits_k40"] else _planned_row(preset, gpus_per_node, inter_node_gbs, 1))
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| preset | K40s | paper TFLOPS/GPU | predicted | predicted / paper | step (s) | compute | all-to-all | "
             "vocabulary rows | gradient sync | optimizer | fits 12 GB | --grad-accum |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["parts_s"]
        lines.append(f"| {r['preset']} | {r['gpus']} | {r['paper_tflops_per_gpu']:.2f} | "
                     f"{r['predicted_tflops_per_gpu']:.2f} | {r['predicted_over_paper']:.2f} | {r['step_s']:.2f} | "
                     f"{p['compute']:.2f} | {p['all_to_all']:.2f} | {p['vocab_exchange']:.2f} | "
                     f"{p['gradient_sync']:.2f} | {p['optimizer']:.2f} | "
                     f"{'yes' if r['fits_k40'] else 'no'} ({r['gib_per_gpu']:.1f} GiB) | {r['grad_accum']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rows = paper_rows(args.gpus_per_node, args.inter_node_gbs)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
