"""tools/bench_overlap.py: the router's backward products against autograd, a tiny run end to end (JSON lines,
the experts' gradients unchanged by running beside the router's products), and one-line flag errors. The
timings themselves are not asserted: speed is the tool's job, not the tests'."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tests.paths import TOOLS

BENCH = TOOLS / "bench_overlap.py"
TINY = ["--tokens", "64", "--d", "16", "--h", "32", "--repeats", "2", "--threads", "2"]


def _run(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=120, env=env)


def test_router_backward_products_are_the_gate_matrices_gradients(load_tool):
    bench = load_tool("bench_overlap")
    router = bench.RouterBackward(32, 8, 12, torch.Generator().manual_seed(0))
    w_gate, w_noise = (w.clone().requires_grad_(True) for w in router.w_DE)
    x = router.x_ND.clone().requires_grad_(True)
    torch.autograd.backward([x @ w_gate, x @ w_noise], router.g_NE)
    for got, want in zip(router(), (w_gate.grad, w_noise.grad, x.grad)):
        torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_tiny_run(tmp_path):
    out_file = tmp_path / "overlap.jsonl"
    proc = _run("--experts", "16,64", "--k", "1,2", *TINY, "--out", str(out_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [json.loads(line) for line in out_file.read_text().splitlines()] == rows
    assert [(r["experts"], r["k"]) for r in rows] == [(16, 1), (16, 2), (64, 1), (64, 2)]
    for r in rows:
        assert r["same_gradients"] is True
        assert (r["threads"], r["split"], r["repeats"]) == (2, [1, 1], 2)
        assert min(r["router_backward_s"], r["experts_backward_s"], r["serial_s"], r["concurrent_s"],
                   r["router_backward_split_s"], r["experts_backward_split_s"]) > 0
        assert r["overlap_gain"] > 0 and r["ideal_gain"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--threads", "1"], "--threads must be at least 2"),
    (["--threads", "2", "--experts", "4", "--k", "8"], "--k must not exceed --experts"),
    (["--threads", "2", "--experts", "0"], "positive integer"),
    (["--threads", "2", "--out", "/nonexistent-dir/overlap.jsonl"], "does not exist"),
    (["--threads", "2", "--out", "/"], "is a directory"),
])
def test_bad_flags_give_one_line(flags, message, load_tool, capsys):
    """In-process (parse_args exits 2 before any work); the process itself below. `--threads 2`: the default is
    this process's torch threads (1 on a test worker: tests/parallel.py)."""
    with pytest.raises(SystemExit) as exc:
        load_tool("bench_overlap").parse_args(flags)
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


@pytest.mark.slow   # the tool as a process: torch and moe_scale imported before its flags are read
def test_a_bad_flag_ends_the_process_with_status_2_and_one_line():
    proc = _run("--threads", "1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "--threads must be at least 2" in proc.stderr
