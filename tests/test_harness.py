"""The test harness itself (tests/forked.py): a forked command is a process of its own, its output is captured at
the file-descriptor level, its exit status or death by a signal is reported as subprocess would."""

from __future__ import annotations

import os
import signal

import pytest

from tests import forked, harness_entries


def test_a_child_has_its_own_cwd_env_and_pid_and_fd_level_output(tmp_path):
    env = {**os.environ, "HARNESS_MARK": "given"}
    child = forked.start(harness_entries.report_and_exit, ["3"], cwd=tmp_path, env=env)
    assert child.wait(timeout=60) == 3
    assert child.stdout.splitlines() == [f"python stdout {tmp_path} given {child.pid}", "fd stdout"]
    assert child.stderr == "fd stderr\n"
    assert child.pid != os.getpid() and os.environ.get("HARNESS_MARK") is None and os.getcwd() != str(tmp_path)


def test_a_killed_child_reports_the_signal_and_a_crash_its_traceback(tmp_path):
    child = forked.start(harness_entries.sleep_forever, [], cwd=tmp_path, env=dict(os.environ))
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=60) == -signal.SIGKILL
    crash = forked.start(harness_entries.raise_error, [], cwd=tmp_path, env=dict(os.environ))
    assert crash.wait(timeout=60) == 1 and "RuntimeError: boom" in crash.stderr


def test_a_child_past_its_timeout_is_killed(tmp_path):
    child = forked.start(harness_entries.sleep_forever, [], cwd=tmp_path, env=dict(os.environ))
    with pytest.raises(TimeoutError, match="did not finish"):
        child.wait(timeout=0.5)
    assert child.returncode == -signal.SIGKILL


def test_ranks_stop_together_once_one_fails(tmp_path):
    """As a launcher does: a rank that fails makes the others stop instead of waiting for it forever."""
    ranks = [forked.start(harness_entries.sleep_forever, [], cwd=tmp_path, env=dict(os.environ)),
             forked.start(harness_entries.report_and_exit, ["2"], cwd=tmp_path, env=dict(os.environ))]
    forked.wait_all(ranks, timeout=60)
    assert [r.returncode for r in ranks] == [-signal.SIGKILL, 2]



def test_a_child_starts_with_every_warm_import(tmp_path):
    """The forkserver's preload (tests/warm_imports.py) went through: its ImportError would leave a half-warm server
    and every command about 4 s slower, silently."""
    child = forked.start(harness_entries.report_missing_warm_modules, [], cwd=tmp_path, env=dict(os.environ))
    assert child.wait(timeout=60) == 0, child.stderr
    assert child.stdout.strip() == "", f"not preloaded: {child.stdout}"
