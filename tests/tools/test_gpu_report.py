"""tools/gpu_report.py on the outputs tools/gpu_check.sh writes (made up here), and gpu_check.sh without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.paths import TOOLS



def _write_outputs(out: Path, mfu: float) -> None:
    (out / "tests.xml").write_text('<testsuites><testsuite name="pytest" tests="10" failures="1" errors="0" '
                                   'skipped="2"/></testsuites>')
    rows = []
    for e, ours, theirs, fraction in ((8, 1.0, 1.1, 0.7), (256, 1.0, 3.5, 0.6), (1024, 2.0, 5.0, 0.4)):
        rows.append({"impl": "dropless", "experts": e, "k": 2, "time_s": ours / 1000, "speedup_vs_deepspeed":
                     round(theirs / ours, 2), "roofline_fraction": fraction, "bound": "memory"})
        rows.append({"impl": "deepspeed_dropless", "experts": e, "k": 2, "time_s": theirs / 1000,
                     "roofline_fraction": 0.1, "bound": "memory"})
    rows.append({"impl": "dropless", "experts": 4096, "k": 2, "skipped": "expert weights and gradients need 128 GiB"})
    (out / "layer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, value in (("lstm", 0.2), ("transformer", mfu)):
        (out / name).mkdir()
        (out / name / "summary.json").write_text(json.dumps(
            {"steps": 200, "tokens_per_s": 1e6, "tflops_per_device": value * 989.4, "mfu": value,
             "peak_tflops_per_device": 989.4, "peak_source": "table: NVIDIA H100 80GB HBM3", "valid_ppl": 50.0}))
    (out / "device.txt").write_text("NVIDIA H100 80GB HBM3, compute capability 9.0\n")


@pytest.mark.parametrize("mfu, met", [(0.4, True), (0.2, False)])
def test_report_sums_up_and_checks_each_target(tmp_path, mfu, met):
    _write_outputs(tmp_path, mfu)
    proc = subprocess.run([sys.executable, str(TOOLS / "gpu_report.py"), str(tmp_path)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tests"] == {"tests": 10, "failures": 1, "errors": 0, "skipped": 2, "passed": 7}
    by_e = {r["experts"]: r for r in report["layer"]}
    assert by_e[8]["meets_speedup"] and by_e[256]["meets_speedup"] and not by_e[1024]["meets_speedup"]
    assert by_e[1024]["meets_roofline"] is False and by_e[8]["deepspeed_ms"] == 1.1 and "skipped" in by_e[4096]
    assert report["targets"] == {"speedup": False, "roofline": False, "transformer_mfu": met}
    assert "| 4096 | 2 | skipped" in proc.stdout and (tmp_path / "report.md").read_text() == proc.stdout


def test_report_needs_a_directory(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOLS / "gpu_report.py"), str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_check_refuses_without_a_gpu(tmp_path):
    proc = subprocess.run(["bash", str(TOOLS / "gpu_check.sh"), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
