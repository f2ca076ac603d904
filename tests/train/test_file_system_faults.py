"""A file system that stops taking a run's checkpoints (full, read-only) ends the run in one line whose advice
works: the partial checkpoint is removed, the previous complete one is intact, and after the fix the advised
command (--resume, or --overwrite when there was no checkpoint yet) goes on. Real faults: a tmpfs of a few MiB,
a read-only bind mount (root in a container may mount; elsewhere these tests are skipped). A failure on one rank
stops every rank (no rank left waiting in a collective)."""

from __future__ import annotations

import contextlib
import errno
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from moe_scale.errors import UserError
from moe_scale.train import checkpoint as ckpt
from moe_scale.train.state import TrainState
from tests.cli_runs import TINY, assert_one_line_error, run_cli, run_train, step_log
from tests.multiproc import run_ranks

SETTINGS = [*TINY, "--vocab-size", "2000", "--checkpoint-interval", "1", "--eval-interval", "100"]   # ~5 MiB each


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount here ({proc.stderr.strip()})")


@contextlib.contextmanager
def _tmpfs(path: Path, mib: int):
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path))
    try:
        yield lambda size: _mount("-o", f"remount,size={size}m", str(path))
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def _read_only(path: Path):
    _mount("--bind", str(path), str(path))
    try:
        _mount("-o", "remount,bind,ro", str(path))
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _partials(run: Path) -> list[str]:
    return [p.name for p in (run / "checkpoints").glob(".partial-*")]


@pytest.mark.slow
def test_a_disk_full_at_the_first_checkpoint_advises_overwrite_and_that_works(tmp_path, embedded_cache):
    run = tmp_path / "run"
    with _tmpfs(run, 3) as resize:
        proc = run_cli("train", *SETTINGS, "--max-steps", "2", "--out", str(run), cwd=tmp_path, cache=embedded_cache)
        assert_one_line_error(proc, "writing checkpoint step00000001", "No space left on device",
                              "no earlier checkpoint exists", "free space on that file system, then start the run "
                              "again with --overwrite")
        assert _partials(run) == []
        resize(64)
        run_train([*SETTINGS, "--max-steps", "2", "--overwrite", "--out", str(run)], cwd=tmp_path,
                  cache=embedded_cache)
        assert [r["step"] for r in step_log(run)] == [1, 2]


@pytest.mark.slow
def test_a_disk_full_at_a_later_checkpoint_advises_resume_and_that_works(tmp_path, embedded_cache):
    run = tmp_path / "run"
    with _tmpfs(run, 8) as resize:   # the first checkpoint fits, the second does not
        proc = run_cli("train", *SETTINGS, "--max-steps", "2", "--out", str(run), cwd=tmp_path, cache=embedded_cache)
        assert_one_line_error(proc, "writing checkpoint step00000002", "No space left on device",
                              "the previous complete checkpoint step00000001 is intact",
                              "free space on that file system, then continue with --resume")
        assert _partials(run) == [] and ckpt.usable_checkpoints(run) == ["step00000001"]
        resize(64)
        run_train([*SETTINGS, "--max-steps", "2", "--resume", "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
        assert [r["step"] for r in step_log(run)] == [1, 2]
        assert ckpt.latest_complete_tag(run) == "step00000002"


@pytest.mark.slow
def test_checkpoints_made_read_only_during_a_run_advise_making_them_writable(tmp_path, embedded_cache):
    run = tmp_path / "run"
    run_train([*SETTINGS, "--max-steps", "1", "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
    with _read_only(run / "checkpoints"):
        proc = run_cli("train", "--resume", "--max-steps", "2", "--out", str(run), cwd=tmp_path, cache=embedded_cache)
        assert_one_line_error(proc, "writing checkpoint step00000002", "Read-only file system",
                              "make that directory writable, then continue with --resume")
    assert _partials(run) == []
    run_train(["--resume", "--max-steps", "2", "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
    assert [r["step"] for r in step_log(run)] == [1, 2]


class _FullOnRank1:
    """An engine whose save finds the disk full on rank 1 only."""

    module = None

    def save_checkpoint(self, directory, tag, **_):
        (Path(directory) / tag).mkdir(parents=True, exist_ok=True)
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        (Path(directory) / tag / "mp_rank_00_model_states.pt").write_bytes(b"whole")


def _save_where_rank_1_fails(rank: int, world_size: int, run: str) -> str:
    real = ckpt.save_portable, ckpt._ep_size
    ckpt.save_portable, ckpt._ep_size = (lambda *a: None), (lambda model: 1)   # the fake engine holds no model
    try:
        ckpt.save_checkpoint(_FullOnRank1(), Path(run), TrainState(1, 128, 9, step=9), rank, rows=None, keep=2)
    except UserError as e:
        return str(e)
    finally:   # the rank process is pooled: later tasks get the real module
        ckpt.save_portable, ckpt._ep_size = real
    return "saved"


@pytest.mark.multiprocess
def test_a_write_failing_on_one_rank_stops_every_rank(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    messages = run_ranks(_save_where_rank_1_fails, 2, args=(str(tmp_path / "run"),), timeout=60)
    assert "failed on another process" in messages[0] and "start the run again with --overwrite" in messages[0]
    assert "No space left on device" in messages[1]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == []   # partial removed
    assert not (tmp_path / "run" / "checkpoints" / "complete").exists()
