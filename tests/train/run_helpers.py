"""Run the real CLI in subprocesses (one process, or N through the deepspeed launcher) and read its outputs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

# Small enough for seconds per run on 2 CPU cores.
TINY = ["--d-model", "32", "--expert-hidden", "32", "--num-experts", "8", "--top-k", "2", "--seq-len", "16",
        "--batch-size", "8", "--log-interval", "2", "--eval-max-batches", "4"]


def _env(cache: Path | None) -> dict[str, str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    if cache is not None:
        env["MOE_SCALE_CACHE"] = str(cache)
    return env


def run_train(args: list[str], cwd: Path, cache: Path | None = None, nprocs: int = 1) -> subprocess.CompletedProcess:
    if nprocs == 1:
        cmd = [sys.executable, "-m", "moe_scale", "train", *args]
    else:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nprocs),
               "--master_port", str(free_port()), "--module", "moe_scale", "train", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(cache), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def run_eval(args: list[str], cwd: Path, cache: Path | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-m", "moe_scale", "eval", "--json", *args], cwd=cwd,
                          env=_env(cache), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout)   # `eval --json` prints the JSON object and nothing else on stdout


def step_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
