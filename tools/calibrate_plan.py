#!/usr/bin/env python
"""Check the planner's time model against real training steps on this machine's CPU processes.

1. Constants, with 1, 2 and 4 processes at once (tools/calibrate_bench.py): fp32 matmul TFLOPS per process, the
   optimizer's GB/s, gloo all-to-all (flat and the pairs of the hierarchical hops) and all-reduce latency and
   GB/s. Processes share the cores (and, here, the machine with others): each measures its share.
2. Compute, per model and P, between its two runs: its forward and backward (no DeepSpeed, no exchange, no
   optimizer) on P processes at once, each on its share of the batch: efficiency(P) = the model's FLOPs / (seconds
   x the matmul TFLOPS each process saw), and the share by which the ranks' meeting at a collective lengthens a
   step (the straggler share: what a shared, oversubscribed CPU adds to every synchronisation).
3. Training: `moe-scale train` through the deepspeed launcher, --ep-size P, --all-to-all flat and hierarchical
   (nodes of P/2 ranks: --node-size), each model, `--max-steps` steps (the first 3 untimed), 1 thread per process.
4. Prediction: `moe-scale plan`'s model (accounting/) for each run's layout, on a "GPU" made of the constants,
   beside the measured step time (summary.json) and all-to-all seconds (its share x the step). Nothing is taken
   from the training runs but their vocabulary size (the corpus may have fewer words than --vocab-size).

    python tools/calibrate_plan.py --out runs/calibration                 # small and large models, P = 1, 2, 4
    python tools/calibrate_plan.py --out runs/cal --models tiny --procs 1,2 --max-steps 6

Writes <out>/calibration.json (constants, efficiencies, every point) and calibration.md (the table, also printed);
runs under <out>/runs, launcher logs under <out>/logs. Exit status: 0 done (whatever the agreement); 1 a run
failed; 2 a bad flag.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tool_args import OneLineParser, positive_int, positive_int_list

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # as its runs see it (PYTHONPATH below): a checkout without moe_scale installed

import calibrate_bench  # noqa: E402

MODELS = {
    "tiny": ["--d-model", "16", "--expert-hidden", "32", "--num-experts", "4", "--seq-len", "8", "--batch-size", "8",
             "--vocab-size", "500"],
    "small": ["--d-model", "64", "--expert-hidden", "256", "--num-experts", "16", "--seq-len", "32",
              "--batch-size", "32", "--vocab-size", "2000"],
    "large": ["--d-model", "256", "--expert-hidden", "1024", "--num-experts", "16", "--seq-len", "32",
              "--batch-size", "32", "--vocab-size", "2000"],
}
RUN = ["--top-k", "2", "--log-interval", "1000", "--eval-interval", "1000000", "--eval-max-batches", "1",
       "--checkpoint-interval", "0"]
EXCHANGES = ("flat", "hierarchical")
TOLERANCE = 0.25


def parse_args(argv: list[str]):
    parser = OneLineParser(prog="calibrate_plan.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for the report, runs and logs")
    parser.add_argument("--models", default="small,large", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--procs", type=positive_int_list, default=[1, 2, 4], help="process counts (1, 2, 4)")
    parser.add_argument("--max-steps", type=positive_int, default=12, help="training steps per run (3 untimed)")
    parser.add_argument("--exchanges", default=",".join(EXCHANGES),
                        help="the all-to-alls to calibrate, comma-separated (default: flat,hierarchical)")
    args = parser.parse_args(argv)
    args.exchanges = args.exchanges.split(",")
    if not args.exchanges or any(x not in EXCHANGES for x in args.exchanges) or "flat" not in args.exchanges:
        parser.error(f"--exchanges {','.join(args.exchanges)}: flat, and optionally hierarchical")
    args.models = args.models.split(",")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"--models {','.join(unknown)}: unknown; choose from {', '.join(MODELS)}")
    if any(p not in (1, 2, 4) for p in args.procs):
        parser.error(f"--procs {args.procs}: 1, 2 and 4 processes are calibrated (4 makes two nodes of 2)")
    if args.max_steps < 5:
        parser.error("--max-steps must be at least 5 (3 warm-up steps are not timed)")
    return args


def config_of(flags: list[str]):
    from moe_scale.commands.config_flags import add_config_flags, config_from_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_config_flags(parser)
    return config_from_args(parser.parse_args(flags + RUN))


def train(name: str, flags: list[str], procs: int, exchange: str, args, out: Path) -> dict:
    run_name = f"{name}-p{procs}-{exchange}"
    run_dir, log = out / "runs" / run_name, out / "logs" / f"{run_name}.log"
    node = ["--node-size", str(max(1, procs // 2))] if exchange == "hierarchical" and procs > 1 else []
    from moe_scale.distributed.ports import free_port

    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(procs), "--master_port",
           str(free_port()), "--module", "moe_scale", "train", *flags, *RUN, "--ep-size", str(procs),
           "--all-to-all", exchange, *node, "--max-steps", str(args.max_steps), "--out", str(run_dir), "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    print(f"[{run_name}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    with log.open("w") as handle:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not (run_dir / "summary.json").exists():
        print(f"calibrate_plan.py: run {run_name} failed (exit {proc.returncode}); log {log}:\n"
              f"{log.read_text()[-3000:]}", file=sys.stderr)
        sys.exit(1)
    summary = json.loads((run_dir / "summary.json").read_text())
    vocab = len((run_dir / "vocab").read_text().splitlines())
    return {"step_s": summary["step_seconds"], "all_to_all_s": summary["all_to_all_share"] * summary["step_seconds"],
            "vocab": vocab, "run_dir": str(run_dir)}


def cpu_device(const: dict, compute: dict, efficiency: float):
    """The planner's GPU record for P CPU processes: the measured constants (the matmul rate and the straggler share
    of the model's own P-process measurement), no CUDA reserves, no launch floor and no small-product curve (the
    efficiency is measured with the model's own products and operations, which include both)."""
    from moe_scale.accounting.gpus import GPU

    a2a = const.get("all_to_all", {"latency_s": 0.0, "per_peer_s": 0.0, "gbs": 1e9})
    reduce = const.get("all_reduce", {"latency_s": 0.0, "gbs": 1e9})
    return GPU(f"cpu x{const['procs']}", 1e6, None, compute["matmul_tflops"], const["optimizer_gbs"], a2a["gbs"],
               a2a["gbs"], efficiency, cuda=False, intra_latency_s=a2a["latency_s"], inter_latency_s=a2a["latency_s"],
               per_peer_latency_s=a2a["per_peer_s"], link_efficiency=1.0, hbm_efficiency=1.0,
               reduce_gbs=reduce["gbs"], reduce_latency_s=reduce["latency_s"], straggler=compute["straggler"],
               launch_s=0.0, small_gemm=False)


def predict(config, const: dict, compute: dict, efficiency: float, procs: int, exchange: str) -> dict:
    from moe_scale.accounting.layout import Layout
    from moe_scale.accounting.model_shape import planned_model
    from moe_scale.accounting.plan import Planner
    from moe_scale.layout.ds_config import DEFAULT_DS_CONFIG

    per_node = max(1, procs // 2) if exchange == "hierarchical" else procs
    layout = Layout(procs // per_node, per_node, ep_size=procs, all_to_all=exchange)
    planner = Planner(planned_model(config), cpu_device(const, compute, efficiency), DEFAULT_DS_CONFIG,
                      efficiency=efficiency)
    return planner.plan(layout)["time"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    began = time.time()
    constants = {p: calibrate_bench.constants(p) for p in args.procs}
    points, computes = [], {}
    from moe_scale.accounting.model_shape import planned_model

    for name in args.models:
        config = config_of(MODELS[name])
        for p in args.procs:
            # the compute between the two runs, at the load they ran at; the vocabulary is the run's (the corpus
            # may hold fewer words than --vocab-size)
            runs = {"flat": train(name, MODELS[name], p, "flat", args, out)}
            config.data.vocab_size = runs["flat"]["vocab"]
            computes[f"{name} p{p}"] = compute = calibrate_bench.model_compute(config, config.data.vocab_size, p)
            if "hierarchical" in args.exchanges:
                runs["hierarchical"] = train(name, MODELS[name], p, "hierarchical", args, out)
            flops = planned_model(config).flops_per_token * config.train.batch_size // p * config.data.seq_len
            efficiency = flops / (compute["compute_s"] * compute["matmul_tflops"] * 1e12)
            compute["efficiency"] = efficiency
            for x in runs:
                measured, predicted = runs[x], predict(config, constants[p], compute, efficiency, p, x)
                step = predicted["seconds"]["step"]
                points.append({"model": name, "procs": p, "all_to_all": x, "measured_step_s": measured["step_s"],
                               "predicted_step_s": step, "ratio": step / measured["step_s"],
                               "within_25pct": abs(step / measured["step_s"] - 1) <= TOLERANCE,
                               "measured_all_to_all_s": measured["all_to_all_s"],
                               "predicted_parts_s": predicted["seconds"], "run_dir": measured["run_dir"]})
    report = {"command": "python tools/calibrate_plan.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "cpu_cores": os.cpu_count(), "seconds": time.time() - began, "tolerance": TOLERANCE,
              "constants": {str(p): c for p, c in constants.items()}, "compute": computes, "points": points,
              "within": sum(p["within_25pct"] for p in points), "total": len(points),
              "median_abs_error": statistics.median(abs(p["ratio"] - 1) for p in points)}
    (out / "calibration.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "calibration.md").write_text(table)
    print(table)
    return 0


def markdown(report: dict) -> str:
    lines = ["| model | procs | all-to-all | measured step (ms) | predicted (ms) | predicted / measured | within 25% | "
             "measured all-to-all (ms) | predicted all-to-all (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for p in report["points"]:
        parts = p["predicted_parts_s"]
        lines.append(f"| {p['model']} | {p['procs']} | {p['all_to_all']} | {p['measured_step_s'] * 1e3:.1f} | "
                     f"{p['predicted_step_s'] * 1e3:.1f} | {p['ratio']:.2f} | {'yes' if p['within_25pct'] else 'no'} | "
                     f"{p['measured_all_to_all_s'] * 1e3:.1f} | {parts['all_to_all'] * 1e3:.1f} |")
    lines += ["", f"{report['within']} of {report['total']} points within {report['tolerance']:.0%}; median |error| "
                  f"{report['median_abs_error']:.0%}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
