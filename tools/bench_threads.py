#!/usr/bin/env python
"""Tokens/s of a training run with torch's old thread count and moe_scale's, in one run
(moe_scale/distributed/threads.py; docs/clusters.md#threads, docs/clusters.md#a-busy-machine).

Several processes (--procs P >= 2, under the deepspeed launcher):
    before: OMP_NUM_THREADS = the cores this process may use, set explicitly for every rank: what each rank's
            torch pool took before moe_scale chose (every core);
    after:  OMP_NUM_THREADS unset: moe_scale gives each rank cores // local ranks threads.
One process (--procs 1, `moe-scale train`), usually beside --load N spinning processes (a busy machine):
    before:  OMP_NUM_THREADS = the cores (torch's own count);
    after:   OMP_NUM_THREADS unset: moe_scale takes the cores other processes leave free at start;
    passive: the cores, with OpenMP's passive wait (OMP_WAIT_POLICY=PASSIVE: idle threads sleep, not spin);
    one:     OMP_NUM_THREADS=1.

    python tools/bench_threads.py --out bench_threads.json             # 2 processes, the default LSTM-MoE
    python tools/bench_threads.py --procs 2 --max-steps 30 --repeats 2 --extra --d-model 256
    python tools/bench_threads.py --procs 1 --load 3 --max-steps 100   # the quickstart on a busy machine

Each multi-process run is the README's multi-process command, `deepspeed --log_level warning --num_gpus P --module
moe_scale train --ep-size P --ds-config ds_configs/zero2_ep.json`, for --max-steps steps (no checkpoints, one
validation batch); one process runs `moe-scale train` the same way; its tokens/s is the run's summary (the steps
after 3 warm-up steps). The settings alternate, --repeats times each; the JSON (stdout, and --out) holds every run,
each setting's median and ratio = after / before. The threads of each run are read from its log ("moe-scale:
threads: N"). A run that takes longer than --timeout seconds is killed with its ranks. Exit status: 0 done; 1 a run
failed or was killed; 2 a bad flag.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from json_lines import emit_report
from tool_args import OneLineParser, check_out_file, non_negative_int, positive_int

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # as its runs see it (PYTHONPATH below): a checkout without moe_scale installed

from moe_scale.distributed.ports import free_port  # noqa: E402

LAUNCHER_FLAGS = ["--log_level", "warning"]   # as the README's command
DS_CONFIG = "ds_configs/zero2_ep.json"
FIXED = ["--eval-interval", "1000000", "--eval-max-batches", "1", "--checkpoint-interval", "0"]
OWN_FLAGS = {"--ep-size", "--ds-config", "--out", "--max-steps", "--overwrite", "--resume"}
THREADS_LINE = re.compile(r"moe-scale: threads: (\d+)")


def parse_args(argv: list[str]):
    parser = OneLineParser(prog="bench_threads.py", description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=positive_int, default=2, help="processes (the launcher's --num_gpus; 1: "
                                                                      "moe-scale train alone)")
    parser.add_argument("--load", type=non_negative_int, default=0,
                        help="other processes spinning on the cores while every run goes (a busy machine)")
    parser.add_argument("--max-steps", type=positive_int, default=60, help="training steps per run")
    parser.add_argument("--repeats", type=positive_int, default=1, help="runs of each setting, alternating")
    parser.add_argument("--timeout", type=positive_int, default=600, help="seconds a run may take before it and "
                                                                          "its ranks are killed (exit 1)")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("--extra", nargs="...", default=[], help="the rest goes to `moe-scale train`")
    args = parser.parse_args(argv)
    if args.max_steps < 5:
        parser.error("--max-steps must be at least 5 (3 warm-up steps are not timed)")
    refused = OWN_FLAGS & {a.split("=")[0] for a in args.extra}
    if refused:
        parser.error(f"--extra must not set {sorted(refused)}: the tool sets them")
    check_out_file(parser, args.out)
    return args


def settings(cores: int, procs: int) -> dict[str, dict[str, str | None]]:
    """The environment of each setting (None: unset)."""
    unset = {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None}
    both = {"before": {**unset, "OMP_NUM_THREADS": str(cores)}, "after": unset}
    if procs > 1:
        return both
    return {**both, "passive": {"OMP_NUM_THREADS": str(cores), "OMP_WAIT_POLICY": "PASSIVE"},
            "one": {**unset, "OMP_NUM_THREADS": "1"}}


def command(args, run_dir: Path) -> list[str]:
    train = ["train", "--max-steps", str(args.max_steps), *FIXED, "--out", str(run_dir), *args.extra]
    if args.procs == 1:
        return [sys.executable, "-m", "moe_scale", *train]
    return [sys.executable, "-m", "deepspeed.launcher.runner", *LAUNCHER_FLAGS, "--num_gpus", str(args.procs),
            "--master_port", str(free_port()), "--module", "moe_scale", train[0], "--ep-size", str(args.procs),
            "--ds-config", DS_CONFIG, *train[1:]]


def launch(args, setting: dict[str, str | None], run_dir: Path) -> dict:
    """One run; its tokens/s, the threads its ranks logged, and its command."""
    cmd = command(args, run_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for name, value in setting.items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)   # its own process group: the launcher and its ranks
    try:
        log, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        print(f"bench_threads.py: a run took more than --timeout {args.timeout} s and was killed: {' '.join(cmd)}\n"
              f"{log[-3000:]}", file=sys.stderr)
        sys.exit(1)
    if proc.returncode != 0 or not (run_dir / "summary.json").exists():
        print(f"bench_threads.py: a run failed (exit {proc.returncode}): {' '.join(cmd)}\n{log[-3000:]}",
              file=sys.stderr)
        sys.exit(1)
    logged = THREADS_LINE.findall(log)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"tokens_per_s": summary["tokens_per_s"], "threads_per_process": int(logged[0]) if logged else None,
            "omp_num_threads": setting["OMP_NUM_THREADS"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from moe_scale.distributed.threads import usable_cores   # imports torch: after the flags are checked

    cores = usable_cores()
    chosen = settings(cores, args.procs)
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        with tempfile.TemporaryDirectory(prefix="bench_threads-") as work:
            for repeat in range(args.repeats):
                for name, setting in chosen.items():
                    shown = " ".join(f"{k}={v}" for k, v in setting.items() if v is not None) or "(unset)"
                    print(f"[{name} {repeat + 1}/{args.repeats}] {shown}", file=sys.stderr, flush=True)
                    runs[name].append(launch(args, setting, Path(work) / f"{name}-{repeat}"))
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    median = {name: statistics.median(r["tokens_per_s"] for r in rows) for name, rows in runs.items()}
    train = f"train --max-steps {args.max_steps} {' '.join(FIXED)} {' '.join(args.extra)}"
    launcher = f"deepspeed {' '.join(LAUNCHER_FLAGS)} --num_gpus {args.procs} --module moe_scale "
    report = {
        "procs": args.procs, "cores": cores, "load": args.load, "max_steps": args.max_steps,
        "repeats": args.repeats, "extra": args.extra, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "command": (f"moe-scale {train}" if args.procs == 1 else
                    launcher + train.replace("train ", f"train --ep-size {args.procs} --ds-config {DS_CONFIG} ", 1))
        .strip(),
        **{name: {"omp_num_threads": chosen[name]["OMP_NUM_THREADS"], "env": chosen[name], "runs": rows,
                  "tokens_per_s": median[name], "threads_per_process": rows[0]["threads_per_process"]}
           for name, rows in runs.items()},
        "ratio": median["after"] / median["before"],
    }
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
