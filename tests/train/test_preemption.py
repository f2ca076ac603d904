"""SIGTERM, SIGINT and SIGUSR1 (SLURM's --signal) stop a run after its step with a complete checkpoint and exit 0;
--resume then repeats the uninterrupted run step for step. A signal that reaches one rank stops all of them at
the same step. A loss that turns non-finite stops the run before a checkpoint of it is written."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.cli_runs import TINY, assert_one_line_error, run_cli, run_train, start_cli, step_log
from tests.forked import Child, wait_all
from tests.paths import DS_CONFIGS

SETTINGS = [*TINY, "--dropout", "0.1", "--log-interval", "1", "--checkpoint-interval", "1000", "--eval-interval",
            "1000"]


def _wait_for_steps(run: Path, steps: int, ranks: list[Child], timeout: float = 300) -> None:
    deadline = time.time() + timeout
    log = run / "train_log.jsonl"
    while time.time() < deadline and all(rank.poll() is None for rank in ranks):
        if log.exists() and len(log.read_text().splitlines()) >= steps:
            return
        time.sleep(0.1)
    raise AssertionError(f"the run did not log {steps} steps (exit {[rank.poll() for rank in ranks]})")


def _stopped_step(run: Path) -> int:
    return json.loads((run / "checkpoints" / "complete").read_text())["step"]


def _assert_resume_repeats_the_straight_run(tmp_path, cache, run: Path, stopped: int, nprocs: int, extra=()):
    straight = tmp_path / "straight"
    total = stopped + 3
    run_train([*SETTINGS, *extra, "--max-steps", str(total), "--out", str(straight)], cwd=tmp_path, cache=cache,
              nprocs=nprocs)
    run_train(["--resume", "--max-steps", str(total), "--out", str(run)], cwd=tmp_path, cache=cache, nprocs=nprocs)
    assert [r["step"] for r in step_log(run)] == list(range(1, total + 1))
    assert [r["loss"] for r in step_log(run)] == [r["loss"] for r in step_log(straight)]


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT", "SIGUSR1"])
def test_a_signal_checkpoints_and_exits_0_then_resume_continues_exactly(tmp_path, embedded_cache, signal_name):
    run = tmp_path / "run"
    [proc] = start_cli("train", *SETTINGS, "--max-steps", "100000", "--out", str(run), cwd=tmp_path,
                       cache=embedded_cache)
    _wait_for_steps(run, 4, [proc])
    proc.send_signal(getattr(signal, signal_name))
    proc.wait(timeout=300)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err[-3000:]
    stopped = _stopped_step(run)
    assert f"stopped by {signal_name} after step {stopped}: checkpoint step{stopped:08d} written; resume with " \
           f"--resume" in out
    assert "Traceback" not in err and not (run / "lock").exists() and not (run / "summary.json").exists()
    if signal_name == "SIGTERM":   # the rest is the same for every signal
        _assert_resume_repeats_the_straight_run(tmp_path, embedded_cache, run, stopped, 1)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_signal_to_one_rank_stops_both_at_the_same_step(tmp_path, embedded_cache):
    run = tmp_path / "run"
    ranks = ["--ep-size", "2", "--ds-config", str(DS_CONFIGS / "zero2_ep.json")]
    workers = start_cli("train", *SETTINGS, *ranks, "--max-steps", "100000", "--out", str(run), cwd=tmp_path,
                        cache=embedded_cache, nprocs=2)
    _wait_for_steps(run, 4, workers)
    workers[1].send_signal(signal.SIGUSR1)   # rank 1 only
    wait_all(workers, timeout=300)
    assert [w.returncode for w in workers] == [0, 0], workers[1].stderr[-3000:]
    out = workers[0].stdout
    stopped = _stopped_step(run)
    assert f"stopped by SIGUSR1 after step {stopped}" in out
    _assert_resume_repeats_the_straight_run(tmp_path, embedded_cache, run, stopped, 2, ranks)


def test_divergence_stops_before_a_checkpoint_of_it(tmp_path, embedded_cache):
    run = tmp_path / "run"
    proc = run_cli("train", *TINY, "--lr", "1e6", "--warmup-steps", "0", "--max-steps", "60", "--log-interval", "5",
                   "--checkpoint-interval", "5", "--out", str(run), cwd=tmp_path, cache=embedded_cache)
    line = assert_one_line_error(proc, "training diverged at step", "stopped before writing a checkpoint of it")
    bad_step = int(line.split("diverged at step ")[1].split(":")[0])
    saved = sorted(int(p.name[4:]) for p in (run / "checkpoints").glob("step*"))
    assert all(step < bad_step for step in saved), (saved, bad_step)
    if saved:
        assert f"step{saved[-1]:08d}" in line
    assert not (run / "lock").exists()
