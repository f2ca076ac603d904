"""tools/bench_vocab_exchange.py (and tools/comm_bytes.py under it): both exchanges of 2 processes at a tiny size,
end to end; flag errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.paths import TOOLS

TOOL = TOOLS / "bench_vocab_exchange.py"


# Size: the tool's smallest vocabulary (1,000 types) and --max-steps 6 (its minimum) at d 16: two deepspeed-launcher
# runs of 2 processes, each table exchanged once whole and once by rows.
@pytest.mark.slow
@pytest.mark.multiprocess
def test_dense_and_rows_on_2_processes(tmp_path):
    out = tmp_path / "vocab.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--procs", "2", "--types", "1000", "--words", "20000",
                           "--d-model", "16", "--max-steps", "6", "--timeout", "280", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    dense, rows = report["runs"]
    assert (dense["mode"], rows["mode"]) == ("dense", "rows") and dense["procs"] == rows["procs"] == 2
    # the whole tables' gradients (1,003 x 16 each, and the softmax's bias) are reduced by ZeRO-2 in every step
    assert dense["bytes_per_rank_per_step"] > 2 * 1003 * 16 * 4 / 2
    assert dense["rows_touched_per_step"] == 0 < rows["rows_touched_per_step"] <= 2 * (2 * 8 * 32 + 1024)
    assert rows["bytes_by_collective"]["vocabulary:all_to_all_single"] > 0
    assert dense["vocabulary_bytes_per_rank_per_step"] == 0
    # the rows there and their gradients back, 1/2 of them staying on their rank; the ids beside them
    touched = rows["rows_touched_per_step"] * 16 * 4
    assert 0.9 < rows["vocabulary_bytes_per_rank_per_step"] * 2 / touched < 2
    for run in (dense, rows):
        assert run["step_seconds"] > 0 and run["tokens_per_s"] > 0
    ratio = report["ratios"]["2"]
    assert ratio["bytes_dense_over_rows"] == dense["bytes_per_rank_per_step"] / rows["bytes_per_rank_per_step"]
    assert ratio["step_seconds_dense_over_rows"] == dense["step_seconds"] / rows["step_seconds"]


@pytest.mark.parametrize("flags, message", [
    (["--procs", "1"], "at least 2"),
    (["--procs", "2,two"], "expected a positive integer, got 'two'"),
    (["--max-steps", "3"], "at least 6"),
    (["--types", "10"], "at least 1000"),
    (["--out", "no/such/dir/x.json"], "does not exist"),
])
def test_flag_errors_are_one_line(tmp_path, flags, message):
    proc = subprocess.run([sys.executable, str(TOOL), *flags], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
