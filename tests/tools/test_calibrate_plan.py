"""tools/calibrate_plan.py: the constants' fits on known data, a tiny calibration end to end on 1 and 2 CPU
processes (every point reported, prediction and measurement side by side), and flag errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.paths import TOOLS

TOOL = TOOLS / "calibrate_plan.py"


def test_the_fits_recover_the_constants_they_were_made_from(load_tool):
    bench = load_tool("calibrate_bench")
    latency, per_peer, gbs = 2e-4, 5e-5, 3.0
    samples = [(g, n, latency + per_peer * (g - 1) + n * (g - 1) / g / (gbs * 1e9))
               for g in (2, 4) for n in bench.A2A_BYTES]
    fit = bench.fit_all_to_all(samples)
    assert fit == pytest.approx({"latency_s": latency, "per_peer_s": per_peer, "gbs": gbs}, rel=1e-6)
    one_size = bench.fit_all_to_all([s for s in samples if s[0] == 2])
    assert one_size["per_peer_s"] == 0 and one_size["gbs"] == pytest.approx(gbs, rel=1e-6)
    reduce = [(n, 1e-4 + 2 * 3 / 4 * n / 2e9) for n in bench.ALLREDUCE_BYTES]
    assert bench.fit_all_reduce(reduce, 4) == pytest.approx({"latency_s": 1e-4, "gbs": 2.0}, rel=1e-6)


# Size: the smallest the tool runs (--models tiny, --max-steps 5, its minimum: 3 untimed steps, the flat exchange
# only: on 2 processes the hierarchical one has one rank per node and is the flat one); the time is its processes
# (the constants' and the compute's spawned ranks, a deepspeed-launcher run), the point of the test.
@pytest.mark.slow
@pytest.mark.multiprocess
def test_tiny_calibration_on_2_processes(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path), "--models", "tiny", "--procs", "2",
                           "--max-steps", "5", "--exchanges", "flat"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "calibration.json").read_text())
    points = report["points"]
    assert [(p["procs"], p["all_to_all"]) for p in points] == [(2, "flat")]
    for p in points:
        summary = json.loads((tmp_path / "runs" / f"tiny-p{p['procs']}-{p['all_to_all']}" / "summary.json").read_text())
        assert p["measured_step_s"] == summary["step_seconds"] and summary["ep_size"] == p["procs"]
        assert p["ratio"] == pytest.approx(p["predicted_step_s"] / p["measured_step_s"])
        assert p["within_25pct"] == (abs(p["ratio"] - 1) <= 0.25)
        assert p["predicted_step_s"] == pytest.approx(sum(v for k, v in p["predicted_parts_s"].items() if k != "step"))
    assert all(p["predicted_parts_s"]["all_to_all"] > 0 for p in points)
    assert set(report["constants"]) == {"2"} and report["constants"]["2"]["all_to_all"]["gbs"] > 0
    assert report["within"] == sum(p["within_25pct"] for p in points) and report["total"] == 1
    assert (tmp_path / "calibration.md").read_text() in proc.stdout


@pytest.mark.parametrize("args,fragment", [
    (["--procs", "3"], "1, 2 and 4 processes"),
    (["--models", "huge"], "--models huge: unknown"),
    (["--max-steps", "3"], "at least 5"),
    (["--exchanges", "hierarchical"], "--exchanges hierarchical: flat, and optionally hierarchical"),
])
def test_bad_flags_are_one_line(tmp_path, args, fragment):
    proc = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path / "cal"), *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "cal").exists()
