"""tools/bench_memory.py at a tiny size: JSON per configuration, the factored optimizer's state cut, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.paths import TOOLS

BENCH = TOOLS / "bench_memory.py"


@pytest.mark.slow
def test_bench_memory_reports_each_configuration(tmp_path):
    out = tmp_path / "mem.jsonl"
    proc = subprocess.run([sys.executable, str(BENCH), "--experts", "8", "--d", "64", "--h", "128", "--batch", "2",
                           "--seq-len", "4", "--vocab", "20", "--steps", "1", "--configs", "baseline,both",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    base, both, summary = lines
    assert (base["config"], both["config"]) == ("baseline", "both") and summary["summary"]
    assert base["peak_rss_mb"] >= base["rss_before_model_mb"] > 0
    # Adam: m and v of 8 x (64x128 + 128x64) floats = 1 MiB; factored: 8 x 2 x (64 + 128) floats
    assert base["expert_optimizer_state_mb"] == 1.0
    assert both["expert_optimizer_state_mb"] == round(8 * 2 * 192 * 4 / 2**20, 3)
    assert summary["expert_optimizer_state_reduction"] >= 40
    # recompute keeps fewer bytes for the backward pass (the experts' hidden activations, 8 tokens x k=4 x 128)
    assert base["saved_for_backward_mb"] - both["saved_for_backward_mb"] >= 8 * 4 * 128 * 4 / 2**20 - 1e-3


def test_bench_memory_flag_error_is_one_line():
    proc = subprocess.run([sys.executable, str(BENCH), "--configs", "baseline,nope"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "nope" in proc.stderr
