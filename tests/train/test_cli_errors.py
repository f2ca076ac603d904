"""Helpers for bad-input tests (one clear line on stderr, exit status 2, no traceback); the table of cases is
test_bad_input.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FAST = ["--max-steps", "1", "--batch-size", "4", "--seq-len", "8", "--eval-max-batches", "1"]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_scale.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("moe-scale: error:")]
    assert len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def test_hierarchical_node_layout_is_checked(monkeypatch):
    from moe_scale.errors import UserError
    from moe_scale.train.loop import _check_node_layout

    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match="pass --node-size"):
        _check_node_layout(4, 0)
    with pytest.raises(UserError, match="must divide one another"):
        _check_node_layout(4, 3)
    _check_node_layout(4, 2), _check_node_layout(2, 8)          # whole nodes / inside one node: fine
    monkeypatch.setenv("LOCAL_SIZE", "3")                      # the deepspeed launcher's variable
    with pytest.raises(UserError, match="3 ranks per node"):
        _check_node_layout(4, 0)
