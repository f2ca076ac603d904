"""Fault injection: a run killed with SIGKILL (no handler runs, nothing is flushed) at a random step or at any point
of a checkpoint write must leave its newest complete checkpoint whole, and `--resume` (or `--overwrite` when no
checkpoint was complete yet) must then train exactly the steps an uninterrupted run takes: the same losses, each
step logged once. The kill points of a checkpoint write are injected by tests/train/fault_inject.py."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from moe_scale.train import checkpoint as ckpt
from tests.cli_runs import TINY, assert_one_line_error, run_cli, run_train, start_cli, step_log
from tests.forked import wait_all
from tests.train import fault_inject
from tests.paths import DS_CONFIGS

STEPS = 6
SETTINGS = [*TINY, "--log-interval", "1", "--checkpoint-interval", "2", "--eval-interval", "1000",
            "--max-steps", str(STEPS)]
TWO_RANKS = ["--ep-size", "2", "--ds-config", str(DS_CONFIGS / "zero2_ep.json")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, embedded_cache) -> list[dict]:
    """The uninterrupted run's log."""
    run = tmp_path_factory.mktemp("straight") / "run"
    run_train([*SETTINGS, "--out", str(run)], cwd=run.parent, cache=embedded_cache)
    return step_log(run)


def _resume_and_compare(run: Path, straight: list[dict], cache: Path, nprocs: int = 1, extra=()) -> None:
    """After the kill: the marker's checkpoint verifies; resume (or start again) and match the straight run."""
    tag = ckpt.latest_complete_tag(run)
    if tag is None:
        proc = run_cli("train", "--resume", "--out", str(run), cwd=run.parent, cache=cache)
        assert_one_line_error(proc, "before its first complete checkpoint", "--overwrite")
        proc = run_cli("train", *SETTINGS, *extra, "--overwrite", "--out", str(run), cwd=run.parent, cache=cache,
                       nprocs=nprocs)
    else:
        assert ckpt.problem_with(run / "checkpoints" / tag) is None, tag
        proc = run_cli("train", "--resume", "--out", str(run), cwd=run.parent, cache=cache, nprocs=nprocs)
    if (run / "summary.json").exists() and tag == f"step{STEPS:08d}" and proc.returncode == 2:
        # the kill came after the summary: the run had finished, and a resume with nothing to do changes nothing
        assert_one_line_error(proc, "has finished")
    else:
        assert proc.returncode == 0, proc.stderr[-4000:]
        if nprocs == 1:   # the killed process's lock names a dead process (with 2, rank 0 fails on its own)
            assert "taking over the stale lock" in proc.stderr
        assert not (run / "lock").exists()
    log = step_log(run)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in log] == [r["loss"] for r in straight]
    assert ckpt.usable_checkpoints(run)[0] == f"step{STEPS:08d}"
    assert not list((run / "checkpoints").glob(".partial-*"))


def _kill_at_a_random_step(run: Path, cache: Path, seed: int, nprocs: int = 1, extra=()) -> None:
    """Start the run, wait until a random step is logged and a random fraction of a second more, SIGKILL a rank."""
    rng = random.Random(seed)
    kill_after, delay = rng.randint(1, STEPS - 1), rng.uniform(0.0, 0.5)
    ranks = start_cli("train", *SETTINGS, *extra, "--out", str(run), cwd=run.parent, cache=cache, nprocs=nprocs)
    log, deadline = run / "train_log.jsonl", time.time() + 300
    while all(rank.poll() is None for rank in ranks) and time.time() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.02)
    time.sleep(delay)
    ranks[-1].kill()   # with 2 ranks, the last one only
    wait_all(ranks, timeout=120)
    if ranks[-1].returncode == 0:
        pytest.fail(f"the run finished before the kill (after step {kill_after} + {delay:.2f} s)")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_9_at_a_random_step_then_resume(tmp_path, embedded_cache, straight, seed):
    _kill_at_a_random_step(tmp_path / "run", embedded_cache, seed)
    _resume_and_compare(tmp_path / "run", straight, embedded_cache)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_kill_9_of_one_rank_of_two_then_resume(tmp_path, embedded_cache):
    straight = tmp_path / "straight"
    run_train([*SETTINGS, *TWO_RANKS, "--out", str(straight)], cwd=tmp_path, cache=embedded_cache, nprocs=2)
    _kill_at_a_random_step(tmp_path / "run", embedded_cache, 3, nprocs=2, extra=TWO_RANKS)
    _resume_and_compare(tmp_path / "run", step_log(straight), embedded_cache, nprocs=2, extra=TWO_RANKS)


def _killed_during_save(tmp_path: Path, cache: Path, step: int, point: str, nth: int) -> Path:
    run = tmp_path / "run"
    proc = run_cli(str(step), point, str(nth), "train", *SETTINGS, "--out", str(run), cwd=tmp_path, cache=cache,
                   entry=fault_inject.main)
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point} #{nth} of step {step}: {proc.stderr[-3000:]}"
    return run


@pytest.mark.slow
@pytest.mark.parametrize("point, step, nth_range", [
    ("save", 2, (1, 12)),      # the first checkpoint: nothing complete yet
    ("save", 4, (1, 12)),      # DeepSpeed's files (model, experts, optimizer) and the portable state
    ("json", 4, (2, 2)),       # manifest.json (after layout.json)
    ("json", 4, (3, 3)),       # the complete marker
    ("rename", 4, (1, 1)),
    ("cleanup", 6, (1, 1)),    # step 2 half deleted after the marker moved to step 6
])
def test_kill_9_during_a_checkpoint_write_then_resume(tmp_path, embedded_cache, straight, point, step, nth_range):
    nth = random.Random(f"{point}{step}").randint(*nth_range)
    run = _killed_during_save(tmp_path, embedded_cache, step, point, nth)
    previous = {2: None, 4: "step00000002", 6: "step00000006"}[step]
    if point == "json" and nth == 3:   # killed renaming the marker into place: the old marker stays
        previous = "step00000002"
    assert ckpt.latest_complete_tag(run) == previous
    _resume_and_compare(run, straight, embedded_cache)
