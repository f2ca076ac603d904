#!/usr/bin/env python
"""Weak and strong scaling sweeps of `moe-scale train`, launched through the `deepspeed` launcher.

    weak:    experts ∝ ranks and sequences per rank fixed (experts = --experts-per-rank x N,
             global batch = --seqs-per-rank x N); expert parallelism over all N ranks.
             efficiency(N) = TFLOPS/device at N / TFLOPS/device at the baseline N
    strong:  a fixed model (--num-experts) and global batch (--batch-size) on N ranks, --ep-size N.
             efficiency(N) = T_base · N_base / (T_N · N), T the step time

The baseline is the smallest N swept (recorded in the report). For each N one run directory
<out>/runs/<mode>-n<N>/ (config, summary.json, TensorBoard events under tb/) and its launcher log
<out>/logs/<mode>-n<N>.log. The report: <out>/scaling_<mode>.md (Markdown table, linking each run's
TensorBoard event directory), scaling_<mode>.json, and PNG plots scaling_<mode>_throughput.png
(tokens/s and TFLOPS/device against N) and scaling_<mode>_efficiency.png (efficiency and all-to-all share).

    python tools/scaling_sweep.py weak --procs 1,2,4 --out runs/weak                    # CPU processes here
    python tools/scaling_sweep.py strong --procs 1,2,4 --num-experts 16 --batch-size 32 --out runs/strong
    python tools/scaling_sweep.py weak --procs 8,16,32 --deepspeed-args "--hostfile hostfile" \\
        --out runs/weak-gpu --extra --d-model 512 --expert-hidden 1024 --ds-config ds_configs/gpu_bf16_zero2.json

--procs are processes per launch (the launcher's --num_gpus; with a hostfile, processes per node, and N in
the report counts all of them: --nodes-per-run multiplies). --extra passes the rest of the command line to
`moe-scale train` after the tool's own settings. Step time = global tokens per step / tokens per second of
the timed steps (the first 3 steps are not timed). Exit status: 0 done; 1 a run failed; 2 a bad flag.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tool_args import OneLineParser, positive_int

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # as its runs see it (PYTHONPATH below): a checkout without moe_scale installed

from moe_scale.distributed.ports import free_port  # noqa: E402
SMALL = ["--d-model", "32", "--expert-hidden", "32", "--seq-len", "16", "--top-k", "2", "--vocab-size", "2000",
         "--log-interval", "5", "--eval-interval", "1000000", "--eval-max-batches", "1",
         "--checkpoint-interval", "1000000"]
OWN_FLAGS = {"--num-experts", "--batch-size", "--ep-size", "--out", "--max-steps"}


def parse_args(argv: list[str]):
    parser = OneLineParser(prog="scaling_sweep.py", description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("weak", "strong"))
    parser.add_argument("--procs", default="1,2,4", help="comma-separated process counts N")
    parser.add_argument("--nodes-per-run", type=positive_int, default=1, help="nodes in each launch (hostfile)")
    parser.add_argument("--out", required=True, help="directory for runs, logs and the report")
    parser.add_argument("--max-steps", type=positive_int, default=20)
    parser.add_argument("--experts-per-rank", type=positive_int, default=4, help="weak: experts per rank")
    parser.add_argument("--seqs-per-rank", type=positive_int, default=8, help="weak: sequences per rank per step")
    parser.add_argument("--num-experts", type=positive_int, default=8, help="strong: experts")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="strong: global sequences per step")
    parser.add_argument("--deepspeed-args", default="", help="extra arguments for the deepspeed launcher")
    parser.add_argument("--force-balanced-routing", action="store_true",
                        help="the runs route round-robin (the router runs; as Megatron/NeMo throughputs are measured)")
    parser.add_argument("--extra", nargs="...", default=[], help="the rest goes to `moe-scale train`")
    args = parser.parse_args(argv)
    try:
        args.procs = sorted({int(p) for p in args.procs.split(",")})
    except ValueError:
        parser.error(f"--procs {args.procs!r}: expected comma-separated integers such as 1,2,4")
    if args.procs[0] < 1:
        parser.error("--procs: process counts must be at least 1")
    refused = OWN_FLAGS & {a.split("=")[0] for a in args.extra}
    if refused:
        parser.error(f"--extra must not set {sorted(refused)}: the sweep sets them (use the tool's own flags)")
    if args.max_steps < 5:
        parser.error("--max-steps must be at least 5 (3 warm-up steps are not timed)")
    if args.mode == "strong":
        for n in args.procs:
            world = n * args.nodes_per_run
            if args.num_experts % world or args.batch_size % world:
                parser.error(f"strong scaling: {world} ranks must divide --num-experts {args.num_experts} and "
                             f"--batch-size {args.batch_size}")
    return args


def run_settings(args, world: int) -> tuple[int, int]:
    """(experts, global batch) of the run on `world` ranks."""
    if args.mode == "weak":
        return args.experts_per_rank * world, args.seqs_per_rank * world
    return args.num_experts, args.batch_size


def launch(args, procs: int, out: Path) -> dict:
    world = procs * args.nodes_per_run
    experts, batch = run_settings(args, world)
    name = f"{args.mode}-n{world}"
    run_dir, log = out / "runs" / name, out / "logs" / f"{name}.log"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(procs), "--master_port",
           str(free_port()), *args.deepspeed_args.split(), "--module", "moe_scale", "train", *SMALL,
           "--num-experts", str(experts), "--batch-size", str(batch), "--ep-size", str(world),
           "--max-steps", str(args.max_steps), "--out", str(run_dir), "--overwrite",
           *(["--force-balanced-routing"] if args.force_balanced_routing else []), *args.extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"[{name}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    with log.open("w") as handle:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not (run_dir / "summary.json").exists():
        tail = log.read_text()[-3000:]
        print(f"scaling_sweep.py: run {name} failed (exit {proc.returncode}); log {log}:\n{tail}", file=sys.stderr)
        sys.exit(1)
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    tokens_per_step = config["train"]["batch_size"] * config["data"]["seq_len"]
    return {"ranks": world, "experts": experts, "global_batch": batch, "tokens_per_step": tokens_per_step,
            "step_seconds": tokens_per_step / summary["tokens_per_s"], "tokens_per_s": summary["tokens_per_s"],
            "tflops_per_device": summary["tflops_per_device"], "mfu": summary["mfu"],
            "all_to_all_share": summary["all_to_all_share"],
            "force_balanced_routing": config["moe"]["router"].get("force_balanced_routing", False),
            "run_dir": str(run_dir),
            "tensorboard": str(run_dir / "tb")}


def add_efficiency(mode: str, rows: list[dict]) -> dict:
    base = rows[0]
    for row in rows:
        if mode == "weak":
            row["efficiency"] = row["tflops_per_device"] / base["tflops_per_device"]
        else:
            row["efficiency"] = base["step_seconds"] * base["ranks"] / (row["step_seconds"] * row["ranks"])
    return {"ranks": base["ranks"], "tflops_per_device": base["tflops_per_device"],
            "step_seconds": base["step_seconds"]}


DEFINITIONS = {
    "weak": "weak scaling (experts ∝ ranks, sequences per rank fixed): efficiency = TFLOPS/device at N / "
            "TFLOPS/device at the baseline",
    "strong": "strong scaling (fixed model and global batch): efficiency = T_base·N_base / (T_N·N), T the step time",
}


def markdown(mode: str, rows: list[dict], baseline: dict, out: Path) -> str:
    lines = [f"# {mode.capitalize()} scaling", "", DEFINITIONS[mode] + ".", "",
             f"Baseline: N = {baseline['ranks']} ({baseline['step_seconds'] * 1e3:.1f} ms/step, "
             f"{baseline['tflops_per_device']:.4g} TFLOPS/device).", "",
             *([f"Routing forced balanced (--force-balanced-routing) in the runs of N = "
                f"{', '.join(str(r['ranks']) for r in rows if r['force_balanced_routing'])}: the router ran, the "
                f"tokens went to the experts round-robin.", ""] if any(r["force_balanced_routing"] for r in rows)
               else []),
             "| N | experts | global batch | step (ms) | tokens/s | TFLOPS/device | MFU | all-to-all share | "
             "efficiency | TensorBoard |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tb = os.path.relpath(r["tensorboard"], out)
        lines.append(f"| {r['ranks']} | {r['experts']} | {r['global_batch']} | {r['step_seconds'] * 1e3:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['tflops_per_device']:.4g} | {r['mfu']:.2%} | "
                     f"{r['all_to_all_share']:.1%} | {r['efficiency']:.2f} | [{tb}]({tb}) |")
    lines += ["", f"Plots: ![throughput](scaling_{mode}_throughput.png) ![efficiency](scaling_{mode}_efficiency.png)",
              "", f"View all runs: `tensorboard --logdir {os.path.relpath(out / 'runs', out)}`"]
    return "\n".join(lines) + "\n"


def plots(mode: str, rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r["ranks"] for r in rows]
    fig, left = plt.subplots(figsize=(6, 4))
    left.plot(ranks, [r["tokens_per_s"] for r in rows], "o-", label="tokens/s")
    left.set_xlabel("ranks N")
    left.set_xticks(ranks)
    left.set_ylabel("tokens/s")
    right = left.twinx()
    right.plot(ranks, [r["tflops_per_device"] for r in rows], "s--", color="tab:orange", label="TFLOPS/device")
    right.set_ylabel("TFLOPS/device")
    lines = left.get_lines() + right.get_lines()
    left.legend(lines, [line.get_label() for line in lines], loc="upper left")
    left.set_title(f"{mode} scaling: throughput")
    fig.tight_layout()
    fig.savefig(out / f"scaling_{mode}_throughput.png", dpi=100)
    plt.close(fig)

    fig, axis = plt.subplots(figsize=(6, 4))
    axis.plot(ranks, [r["efficiency"] for r in rows], "o-", label="scaling efficiency")
    axis.plot(ranks, [r["all_to_all_share"] for r in rows], "s--", label="all-to-all share of step time")
    axis.set_xlabel("ranks N")
    axis.set_xticks(ranks)
    axis.set_ylim(bottom=0)
    axis.legend()
    axis.set_title(f"{mode} scaling: efficiency (baseline N={rows[0]['ranks']})")
    fig.tight_layout()
    fig.savefig(out / f"scaling_{mode}_efficiency.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    rows = [launch(args, procs, out) for procs in args.procs]
    baseline = add_efficiency(args.mode, rows)
    report = markdown(args.mode, rows, baseline, out)
    (out / f"scaling_{args.mode}.md").write_text(report)
    (out / f"scaling_{args.mode}.json").write_text(json.dumps({"mode": args.mode, "definition": DEFINITIONS[args.mode],
                                                               "baseline": baseline, "rows": rows}, indent=2) + "\n")
    plots(args.mode, rows, out)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
