"""tools/bench_experts.py end to end at a tiny size: JSON lines, all impls, every kernel == sliced_loop, flag
errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.paths import TOOLS

BENCH = TOOLS / "bench_experts.py"
TINY = ["--tokens", "64", "--d", "16", "--h", "32", "--repeats", "1"]


def _run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_bench_experts_tiny(tmp_path):
    out_file = tmp_path / "bench.jsonl"
    proc = _run("--experts", "4,16", *TINY, "--max-naive-experts", "4", "--out", str(out_file))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert out_file.read_text().splitlines() == proc.stdout.splitlines()
    by_key = {(line["experts"], line["impl"]): line for line in lines}
    assert set(by_key) == {(e, impl) for e in (4, 16) for impl in ("grouped", "sliced_loop", "dense")}
    assert by_key[(4, "grouped")]["kernel"].startswith("auto: ") and by_key[(4, "dense")]["kernel"] is None
    for line in lines:
        assert (line["k"], line["tokens"], line["rows"], line["d"], line["h"]) == (2, 64, 128, 16, 32)

    # E=4: everything measured and compared
    for impl in ("grouped", "sliced_loop", "dense"):
        line = by_key[(4, impl)]
        assert line["skipped"] is None
        assert line["ms_per_step"] > 0 and line["speedup_vs_sliced_loop"] > 0 and line["ratio_to_dense"] > 0
    assert by_key[(4, "sliced_loop")]["speedup_vs_sliced_loop"] == 1.0
    assert by_key[(4, "dense")]["ratio_to_dense"] == 1.0
    for impl in ("grouped", "sliced_loop"):
        assert 0 <= by_key[(4, impl)]["max_abs_diff"] < 1e-4

    # E=16 > --max-naive-experts: sliced_loop skipped, and said so
    skipped = by_key[(16, "sliced_loop")]
    assert skipped["ms_per_step"] is None and "max-naive-experts" in skipped["skipped"]
    assert "skipped" in proc.stderr
    assert by_key[(16, "grouped")]["ms_per_step"] > 0 and by_key[(16, "grouped")]["speedup_vs_sliced_loop"] is None


@pytest.mark.slow
def test_bench_experts_times_each_kernel_asked_for_and_checks_it_against_the_loop():
    from moe_scale.moe.cpu_backend import kernels as cpu_kernels
    import torch

    kernels = ["loop", "grouped"] + (["native"] if cpu_kernels.available(torch.empty(0)) else [])
    proc = _run("--experts", "4", *TINY, "--kernels", ",".join(kernels))
    assert proc.returncode == 0, proc.stderr
    grouped = [json.loads(line) for line in proc.stdout.splitlines() if '"grouped"' in line]
    assert [line["kernel"] for line in grouped] == kernels
    for line in grouped:
        assert line["ms_per_step"] > 0 and 0 <= line["max_abs_diff"] < 1e-4


@pytest.mark.slow   # the tool as a process: torch and moe_scale imported before its flags are read
def test_bench_experts_bad_flag_exits_2_with_one_line():
    proc = _run("--tokens", "0", *TINY)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "--tokens" in proc.stderr


@pytest.mark.parametrize("flags", [["--d", "-3"], ["--experts", "8,-1"], ["--experts", "4,,5"], ["--repeats", "x"],
                                   ["--max-naive-experts", "-1"], ["--bogus"], ["--out", "/nonexistent/dir/x.jsonl"],
                                   ["--kernels", "fast"], ["--kernels", "loop,loop"]])
def test_bench_experts_bad_flags_in_process(flags, capsys, load_tool):
    """The same check without a process per case: parse_args exits 2 with one line, before any work."""
    bench = load_tool("bench_experts")
    with pytest.raises(SystemExit) as exc:
        bench.parse_args([*flags, *TINY])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error" in err
