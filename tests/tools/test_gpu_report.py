"""tools/gpu_report.py on the outputs the stages of tools/gpu_check.sh leave (made up here): each stage recorded in
OUT/summary.json with its key numbers, the targets checked, report.md rewritten."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.paths import TOOLS

PYTEST_LOG = """tests/gpu/test_cuda.py::test_layer_on_cuda_matches_the_cpu_float32_reference[bf16-flat] PASSED [ 10%]
tests/gpu/test_cuda.py::test_layer_on_cuda_matches_the_cpu_float32_reference[bf16-swiglu] FAILED [ 20%]
tests/gpu/test_cuda.py::test_kernels_chosen_on_this_gpu SKIPPED (float32 takes the Triton kernel) [ 30%]
tests/gpu/test_cuda.py::test_one_host_read_forward_and_none_backward_on_the_device[64] PASSED [ 40%]
tests/gpu/test_cuda.py::test_one_host_read_forward_and_none_backward_on_the_device[2048]
"""   # the last test was cut by the stage's limit: it has no result


def _report(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / "gpu_report.py"), str(out), *args], capture_output=True,
                          text=True)


def _layer_rows(dtype: str) -> list[dict]:
    rows = []
    for e, ours, theirs, fraction in ((8, 1.0, 1.1, 0.7), (64, 1.0, 2.0, 0.6), (256, 1.0, 3.5, 0.6)):
        rows.append({"impl": "dropless", "experts": e, "k": 2, "dtype": dtype, "time_s": ours / 1000,
                     "speedup_vs_deepspeed": round(theirs / ours, 2), "roofline_fraction": fraction,
                     "bound": "memory"})
        rows.append({"impl": "deepspeed_dropless", "experts": e, "k": 2, "dtype": dtype, "time_s": theirs / 1000,
                     "roofline_fraction": 0.1, "bound": "memory"})
    return rows


def _stages(out: Path, work: Path, mfu: float) -> None:
    for name in ("env", "tests_bf16", "train/run"):
        (work / "stages" / name).mkdir(parents=True)
    (work / "stages" / "env" / "env.json").write_text(json.dumps({
        "python": "3.12.3", "device": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.2,
        "cuda_available": True, "error": None,
        "imports": {"torch": {"version": "2.11.0+cu130", "seconds": 2.0}, "deepspeed": {"version": "0.19.8",
                                                                                        "seconds": 3.0}}}))
    (work / "stages" / "tests_bf16" / "log").write_text(PYTEST_LOG)
    (out / "layer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _layer_rows("bfloat16"))
                                     + '{"impl": "dropless", "experts": 1024')   # a line cut at the limit
    (work / "stages" / "train" / "run" / "summary.json").write_text(json.dumps(
        {"steps": 60, "tokens_per_s": 1e6, "tflops_per_device": mfu * 989.4, "mfu": mfu,
         "peak_tflops_per_device": 989.4, "peak_source": "table: NVIDIA H100 80GB HBM3", "valid_ppl": 50.0}))
    (out / "step_syncs.jsonl").write_text(json.dumps({"model": "transformer", "host_reads": 2, "ops": 1400,
                                                      "reads": ["a.py:1"] * 40}) + "\n")


@pytest.mark.parametrize("mfu, met", [(0.4, True), (0.2, False)])
def test_each_stage_is_recorded_with_its_numbers_and_the_targets(tmp_path, mfu, met):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    _stages(out, work, mfu)
    assert _report(out, "--start", "rehearse=0", "budget_s=420").returncode == 0
    for name, status, seconds in (("env", "ok", "31.5"), ("tests_bf16", "timeout", "45"), ("layer", "ok", "50"),
                                  ("step_syncs", "ok", "20"), ("train", "ok", "70"), ("layer_fp32", "skipped", "0")):
        proc = _report(out, "--record", name, status, seconds, "--limit", "60", "--work", str(work))
        assert proc.returncode == 0, proc.stderr
        assert json.loads((out / "summary.json").read_text())["stages"][-1]["name"] == name   # after every stage
    assert _report(out, "--finish", "1", "300").returncode == 0
    summary = json.loads((out / "summary.json").read_text())
    stages = {s["name"]: s for s in summary["stages"]}
    assert summary["device"] == "NVIDIA H100 80GB HBM3, compute capability 9.0, 79.2 GiB"
    assert stages["env"]["versions"] == {"torch": "2.11.0+cu130", "deepspeed": "0.19.8"}
    assert stages["env"]["import_seconds"] == 5.0 and stages["env"]["status"] == "ok"
    assert {k: stages["tests_bf16"][k] for k in ("passed", "failed", "errors", "skipped", "not_passed")} == \
        {"passed": 2, "failed": 1, "errors": 0, "skipped": 1,
         "not_passed": ["test_layer_on_cuda_matches_the_cpu_float32_reference[bf16-swiglu]"]}
    by_e = {r["experts"]: r for r in stages["layer"]["rows"]}
    assert sorted(by_e) == [8, 64, 256] and by_e[8]["deepspeed_ms"] == 1.1 and by_e[8]["dtype"] == "bfloat16"
    assert by_e[8]["meets_speedup"] and by_e[64]["meets_speedup"] and by_e[256]["meets_speedup"]
    assert stages["train"]["mfu"] == mfu and stages["train"]["steps"] == 60
    assert stages["step_syncs"]["rows"] == [{"model": "transformer", "host_reads": 2, "ops": 1400}]
    assert stages["layer_fp32"] == {"name": "layer_fp32", "status": "skipped", "seconds": 0.0, "limit_s": 60.0,
                                    "rows": []}
    assert summary["targets"] == {"speedup": True, "roofline": True, "transformer_mfu": met, "host_reads": True}
    assert summary["check"]["exit_status"] == 1 and summary["check"]["budget_s"] == "420"
    report = (out / "report.md").read_text()
    assert "| tests_bf16 | timeout | 45.0 | 60.0 | 2 passed, 1 failed, 0 errors, 1 skipped (" in report
    assert "| bfloat16 | 256 | 2 | 1.0 | 3.5 | 3.5 | 0.60 | memory |" in report
    assert f"transformer_mfu {'met' if met else 'missed'}" in report
    again = _report(out)
    assert again.returncode == 0 and again.stdout == report


def test_a_layer_row_below_its_target_misses_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    rows = _layer_rows("bfloat16")
    rows[4]["speedup_vs_deepspeed"], rows[0]["roofline_fraction"] = 2.9, 0.4   # E = 256 under 3x; E = 8 under 1/2
    (out / "layer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _report(out, "--start")
    assert _report(out, "--record", "layer", "ok", "1").returncode == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["targets"]["speedup"] is False and summary["targets"]["roofline"] is False
    assert summary["targets"]["transformer_mfu"] is None and summary["targets"]["host_reads"] is None


@pytest.mark.parametrize("args", [[], ["--record", "env", "fine", "1"], ["--bogus"]])
def test_bad_use_is_one_line(tmp_path, args):
    out = tmp_path / "out"
    if args:
        out.mkdir()
    proc = _report(out, *args)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("gpu_report.py: error:")
