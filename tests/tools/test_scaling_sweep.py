"""tools/scaling_sweep.py: a weak-scaling sweep end to end on 1 and 2 CPU processes; the strong-scaling
efficiency formula; flag errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_runs import run_cli
from tests.paths import TOOLS

TOOL = TOOLS / "scaling_sweep.py"
TINY = ["--extra", "--d-model", "16", "--expert-hidden", "16", "--seq-len", "8"]


# Size: the fewest points a weak-scaling row has (1 and 2 processes), 6 steps of TINY; the time is the tool's
# launcher runs.
@pytest.mark.slow
@pytest.mark.multiprocess
def test_weak_sweep_on_1_and_2_processes(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOL), "weak", "--procs", "1,2", "--max-steps", "6",
                           "--experts-per-rank", "4", "--seqs-per-rank", "4", "--out", str(tmp_path), *TINY],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "scaling_weak.json").read_text())
    rows = report["rows"]
    assert [(r["ranks"], r["experts"], r["global_batch"]) for r in rows] == [(1, 4, 4), (2, 8, 8)]
    assert report["baseline"]["ranks"] == 1 and rows[0]["efficiency"] == 1.0
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["tflops_per_device"] / rows[0]["tflops_per_device"])
    assert rows[0]["all_to_all_share"] == 0.0 and 0 < rows[1]["all_to_all_share"] < 1   # no all-to-all on 1 rank
    for row in rows:
        summary = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
        assert summary["world_size"] == row["ranks"] and summary["ep_size"] == row["ranks"]
        assert row["step_seconds"] == pytest.approx(row["tokens_per_step"] / summary["tokens_per_s"])
        assert any(Path(row["tensorboard"]).glob("events.out.tfevents.*"))
    markdown = (tmp_path / "scaling_weak.md").read_text()
    assert "Baseline: N = 1" in markdown and "runs/weak-n2/tb" in markdown and markdown in proc.stdout
    for png in ("scaling_weak_throughput.png", "scaling_weak_efficiency.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_perf_scalars_reach_tensorboard(tmp_path):
    """The runs' event files carry perf/tflops_per_device, perf/mfu and perf/all_to_all_share."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_cli("train", "--preset", "lm1b-moe-32-mini", "--max-steps", "6", "--log-interval", "3", "--out",
            str(tmp_path / "run"), cwd=tmp_path, check=True)
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"perf/tflops_per_device", "perf/mfu", "perf/all_to_all_share"} <= tags
    mfu = events.Scalars("perf/mfu")[-1].value
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mfu"] == pytest.approx(summary["tflops_per_device"] / summary["peak_tflops_per_device"])
    assert mfu == pytest.approx(summary["mfu"], rel=1e-5) and 0 < mfu < 1


def test_strong_efficiency_formula(load_tool):
    tool = load_tool("scaling_sweep")
    rows = [{"ranks": 1, "step_seconds": 1.0, "tflops_per_device": 1.0},
            {"ranks": 2, "step_seconds": 0.8, "tflops_per_device": 0.6},
            {"ranks": 4, "step_seconds": 0.5, "tflops_per_device": 0.5}]
    baseline = tool.add_efficiency("strong", rows)
    assert baseline["ranks"] == 1
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 1.0 / 1.6, 0.5])


@pytest.mark.parametrize("flags,message", [
    (["strong", "--procs", "1,3", "--num-experts", "8"], "must divide --num-experts"),
    (["weak", "--procs", "1,x"], "comma-separated integers"),
    (["weak", "--extra", "--num-experts", "4"], "must not set"),
    (["weak", "--max-steps", "3"], "at least 5"),
])
def test_flag_errors(tmp_path, flags, message):
    proc = subprocess.run([sys.executable, str(TOOL), *flags[:1], "--out", str(tmp_path / "o"), *flags[1:]],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
