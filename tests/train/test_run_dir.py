"""--out and --overwrite never delete what moe_scale did not write; one live run per directory; a start that
fails leaves nothing behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_scale.errors import UserError
from moe_scale.train.run_dir import MARKER, check_run_dir, claim_run_dir, holds_run
from moe_scale.train.run_lock import LOCK_NAME, RunLock, live_owner
from tests.cli_runs import TINY, assert_one_line_error, run_cli, run_train, start_cli, step_log


def _fake_run(run: Path, checkpoint: bool = True) -> None:
    run.mkdir(parents=True)
    (run / MARKER).write_text("{}")
    (run / "config.json").write_text(json.dumps({"model": {}, "data": {}, "train": {}}))
    (run / "train_log.jsonl").write_text("")
    if checkpoint:
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "complete").write_text('{"tag": "step00000001", "step": 1}')


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_overwrite_refuses_a_run_beside_foreign_files(tmp_path):
    run = tmp_path / "run"
    _fake_run(run)
    (run / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"did not write \(notes.txt\)"):
        check_run_dir(str(run), resume=False, overwrite=True)
    assert (run / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("out", ["", "  ", ".", "..", "/"])
def test_empty_current_root_and_parent_directories_are_refused(tmp_path, monkeypatch, out):
    work = tmp_path / "a" / "b"
    _fake_run(work)
    monkeypatch.chdir(work)
    with pytest.raises(UserError, match="--out"):
        check_run_dir(out, resume=False, overwrite=True)
    assert (work / "config.json").exists()


def test_home_is_refused(tmp_path, monkeypatch):
    _fake_run(tmp_path / "home")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(UserError, match="home"):
        check_run_dir(str(tmp_path / "home"), resume=False, overwrite=True)


def test_overwrite_deletes_only_the_runs_own_files(tmp_path):
    run = tmp_path / "run"
    _fake_run(run)
    (run / "tb").mkdir()
    (run / "tb" / "events").write_text("x")
    check_run_dir(str(run), resume=False, overwrite=True)
    lock = claim_run_dir(run, resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME, MARKER]
    lock.release()
    assert sorted(p.name for p in run.iterdir()) == [MARKER]


def test_a_run_that_never_checkpointed_says_how_to_start_again(tmp_path):
    run = tmp_path / "run"
    _fake_run(run, checkpoint=False)
    for resume in (False, True):
        with pytest.raises(UserError, match="before its first complete checkpoint.*--overwrite"):
            check_run_dir(str(run), resume=resume, overwrite=False)
    check_run_dir(str(run), resume=False, overwrite=True)


def test_runs_written_before_the_marker_are_still_runs(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"model": {}, "data": {}, "train": {}}))
    assert holds_run(old)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"name": "some other tool"}')
    assert not holds_run(other)


def test_live_lock_refuses_and_stale_lock_is_taken_over(tmp_path, capfd):
    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock.acquire(run)   # this process: live
    assert "pid" in json.loads((run / LOCK_NAME).read_text())
    with pytest.raises(UserError, match="in use by a live run"):
        check_run_dir(str(run), resume=False, overwrite=True)
    with pytest.raises(UserError, match="in use by a live run"):
        RunLock.acquire(run)
    lock.release()
    assert not (run / LOCK_NAME).exists()

    (run / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "start": "1"}))
    assert live_owner(run) is None
    lock = RunLock.acquire(run)
    assert "taking over the stale lock" in capfd.readouterr().err
    lock.release()

    (run / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start": "0"}))
    assert live_owner(run) is None, "a reused PID (another start time) is not the owner"

    (run / LOCK_NAME).write_text(json.dumps({"host": "another-node", "pid": 1}))
    assert "another-node" in live_owner(run) and "delete" in live_owner(run)


def test_release_leaves_someone_elses_lock(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock.acquire(run)
    (run / LOCK_NAME).write_text(json.dumps({"host": "another-node", "pid": 7}))
    lock.release()
    assert (run / LOCK_NAME).exists()


def test_a_second_run_on_a_live_directory_is_refused(tmp_path, embedded_cache):
    run = tmp_path / "run"
    [first] = start_cli("train", *TINY, "--max-steps", "100000", "--out", str(run), cwd=tmp_path,
                        cache=embedded_cache)
    try:
        deadline = time.time() + 300
        while not (run / LOCK_NAME).exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert first.poll() is None, "the first run ended early"
        for extra in ([], ["--overwrite"], ["--resume"]):
            proc = run_cli("train", *TINY, "--max-steps", "2", "--out", str(run), *extra, cwd=tmp_path)
            assert_one_line_error(proc, "in use by a live run", str(first.pid))
    finally:
        first.kill()
        first.wait()
    assert (run / "config.json").exists()
    # killed with -9: its lock is stale, and --overwrite starts the run again
    proc = run_train([*TINY, "--max-steps", "2", "--out", str(run), "--overwrite"], cwd=tmp_path, cache=embedded_cache)
    assert "taking over the stale lock" in proc.stderr
    assert [r["step"] for r in step_log(run)] == [1, 2]
    assert not (run / LOCK_NAME).exists() and (run / MARKER).exists()


def test_checkpoint_interval_zero_writes_no_checkpoint(tmp_path, embedded_cache):
    """Benchmarks (tools/gpu_check.sh) train without writing tens of GB of checkpoints."""
    run = tmp_path / "run"
    run_train([*TINY, "--max-steps", "3", "--checkpoint-interval", "0", "--out", str(run)], cwd=tmp_path,
              cache=embedded_cache)
    assert (run / "summary.json").is_file() and not (run / "checkpoints").exists()
    assert [r["step"] for r in step_log(run)] == [1, 2, 3]


@pytest.mark.slow   # over 5 s on 2 cores (tests/README.md)
def test_keep_checkpoints_keeps_the_newest_n_and_zero_keeps_all(tmp_path, embedded_cache):
    run = tmp_path / "run"
    tags = lambda: sorted(p.name for p in (run / "checkpoints").glob("step*"))   # noqa: E731
    run_train([*TINY, "--max-steps", "4", "--checkpoint-interval", "1", "--keep-checkpoints", "3", "--out", str(run)],
              cwd=tmp_path, cache=embedded_cache)
    assert tags() == ["step00000002", "step00000003", "step00000004"]
    run_train([*TINY, "--max-steps", "6", "--checkpoint-interval", "1", "--keep-checkpoints", "0", "--resume",
               "--out", str(run)], cwd=tmp_path, cache=embedded_cache)   # may change on resume
    assert tags() == [f"step0000000{i}" for i in range(2, 7)]
    run_train([*TINY, "--max-steps", "7", "--resume", "--keep-checkpoints", "1", "--out", str(run)], cwd=tmp_path,
              cache=embedded_cache)
    assert tags() == ["step00000007"]
    run = tmp_path / "default"
    run_train([*TINY, "--max-steps", "3", "--checkpoint-interval", "1", "--out", str(run)], cwd=tmp_path,
              cache=embedded_cache)
    assert tags() == ["step00000002", "step00000003"]   # the default: 2
    proc = run_cli("train", *TINY, "--keep-checkpoints", "-1", "--out", str(tmp_path / "other"), cwd=tmp_path)
    assert_one_line_error(proc, "--keep-checkpoints must be 0 (keep all) or positive (got -1)")
    assert not (tmp_path / "other").exists()


def test_a_runs_files_are_readable_by_whoever_may_read_the_directory(tmp_path, embedded_cache):
    """Run files are written to a temporary name (owner-only) and renamed: the finished files get the usual
    0666 less the umask, not the temporary file's 0600 (a shared cluster account's group must read them)."""
    run = tmp_path / "run"
    run_train([*TINY, "--max-steps", "2", "--checkpoint-interval", "2", "--out", str(run)], cwd=tmp_path,
              cache=embedded_cache)
    umask = os.umask(0)
    os.umask(umask)
    for name in ("config.json", "ds_config.json", "summary.json", "vocab", "vocab.counts", MARKER,
                 "checkpoints/complete"):
        assert (run / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_help_lists_the_values_of_every_choice_flag():
    from moe_scale.cli import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--gate {noisy_topk,hierarchical,batchwise,softmax_topk,aux_free,node_limited}" in " ".join(text.split())
    assert "an LSTM-MoE or a transformer language model" in " ".join(build_parser().format_help().split())
