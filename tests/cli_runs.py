"""Run `moe-scale` commands as a user would and read what they leave behind.

Each command runs in a fresh process forked from the warm server of tests/forked.py (its own exit status, its own
stdout/stderr as file descriptors, nothing shared with the test or with the next command), through
`moe_scale.cli.main`, as `python -m moe_scale` would run it. Several processes (`nprocs`) are started the way the
deepspeed launcher starts ranks (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR, MASTER_PORT), and like
it, once one rank fails the others are stopped. Where the process start itself is the point (the console
script, `python -m`, the deepspeed launcher, accelerate, srun), tests start real processes with subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from moe_scale.cli import main as cli_main
from moe_scale.distributed.ports import free_port
from tests import forked
from tests.paths import REPO

# Small enough for about 2 s per run on 2 CPU cores.
TINY = ["--d-model", "32", "--expert-hidden", "32", "--num-experts", "8", "--top-k", "2", "--seq-len", "16",
        "--batch-size", "8", "--log-interval", "2", "--eval-max-batches", "4"]
# For commands refused before they train: if one were accepted by mistake, it ends after one small step.
FAST = ["--max-steps", "1", "--batch-size", "4", "--seq-len", "8", "--eval-max-batches", "1"]
# What no command shows a user: notices libraries print for their own developers (moe_scale/console.py).
NOT_FOR_USERS = ("shm_comm_op", "CUDA_VISIBLE_DEVICES", "FutureWarning")
# The deepspeed launcher's flags in the README's command: its warnings and errors, not its progress lines.
LAUNCHER_FLAGS = ("--log_level", "warning")


def cli_env(cache: Path | None = None) -> dict[str, str]:
    """The environment of a command: this process's, on CPU with one thread per process (tests run beside each
    other), with the embedded corpus cached in `cache`, importing this checkout's moe_scale (the processes a
    launcher starts too, whatever checkout is installed)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if cache is not None:
        env["MOE_SCALE_CACHE"] = str(cache)
    return env


def _rank_env(env: dict[str, str], rank: int, nprocs: int, port: int) -> dict[str, str]:
    """What the deepspeed launcher sets for one rank of one node."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_SIZE": str(nprocs),
            "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def start_cli(*args: str, cwd: Path, cache: Path | None = None, env: dict[str, str] | None = None,
              nprocs: int = 1, entry: Callable[[list[str]], int] = cli_main) -> list[forked.Child]:
    """Start `moe-scale ARGS` on `nprocs` ranks; returns the ranks' processes (rank 0 first)."""
    env = cli_env(cache) if env is None else env
    if nprocs == 1:
        return [forked.start(entry, list(args), cwd, env)]
    forked.note_ranks(nprocs)
    port = free_port()
    return [forked.start(entry, list(args), cwd, _rank_env(env, rank, nprocs, port)) for rank in range(nprocs)]


def _finish(ranks: list[forked.Child], timeout: float = 600) -> subprocess.CompletedProcess:
    """Wait for the ranks; the exit status is the first failing rank's (else 0), stdout and stderr every
    rank's in rank order."""
    forked.wait_all(ranks, timeout)
    failed = [r.returncode for r in ranks if r.returncode != 0]
    return subprocess.CompletedProcess(ranks[0].args, failed[0] if failed else 0,
                                       "".join(r.stdout for r in ranks), "".join(r.stderr for r in ranks))


def run_cli(*args: str, cwd: Path, cache: Path | None = None, env: dict[str, str] | None = None, nprocs: int = 1,
            timeout: float = 600, entry: Callable[[list[str]], int] = cli_main,
            check: bool = False) -> subprocess.CompletedProcess:
    """`moe-scale ARGS` to its end: exit status, stdout, stderr (`check`: it must succeed)."""
    proc = _finish(start_cli(*args, cwd=cwd, cache=cache, env=env, nprocs=nprocs, entry=entry), timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def run_train(args: list[str], cwd: Path, cache: Path | None = None, nprocs: int = 1) -> subprocess.CompletedProcess:
    """`moe-scale train ARGS`, which must succeed."""
    return run_cli("train", *args, cwd=cwd, cache=cache, nprocs=nprocs, check=True)


def launch_train(args: list[str], cwd: Path, cache: Path | None = None, nprocs: int = 2,
                 launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N --module moe_scale train ARGS` with DeepSpeed's own launcher, in real processes: for
    the tests whose point is the launcher (the README's command); it must succeed."""
    forked.note_ranks(nprocs)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", *LAUNCHER_FLAGS, "--num_gpus", str(nprocs),
           "--master_port", str(free_port()), *launcher, "--module", "moe_scale", "train", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=cli_env(cache), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def run_eval(args: list[str], cwd: Path, cache: Path | None = None) -> dict:
    """`moe-scale eval --json ARGS`: its JSON result (it prints that object and nothing else on stdout)."""
    proc = run_cli("eval", "--json", *args, cwd=cwd, cache=cache)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout)


def assert_only_what_helps(proc: subprocess.CompletedProcess) -> None:
    """Neither stdout nor stderr shows a line of NOT_FOR_USERS."""
    for name, text in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        shown = [notice for notice in NOT_FOR_USERS if notice in text]
        assert not shown, f"{name} shows {shown}:\n{text[-4000:]}"


def step_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """A user's mistake: exit status 2, no traceback, exactly one `moe-scale: error:` line holding every
    fragment. Returns the line."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("moe-scale: error:")]
    assert len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]
