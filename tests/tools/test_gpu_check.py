"""tools/gpu_check.sh's guarantees, with stages of the test's own (GPU_CHECK_STAGE_<name>): a hanging stage is
stopped at its limit with its Python stack in the log while the others' results and summary.json stay in OUT; a
failed import stops the check; the budget trims limits and skips what no longer fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.paths import TOOLS

HANG = """
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
def stuck_here():
    time.sleep(120)
stuck_here()
"""


def _check(tmp_path: Path, timeout: float = 60, **settings: str) -> tuple[subprocess.CompletedProcess, Path, dict]:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GPU_CHECK_", "LIMIT_")) and k not in ("STAGES", "BUDGET", "WHEELS", "REHEARSE")}
    env.update(WORK=str(tmp_path / "work"), **settings)
    proc = subprocess.run(["bash", str(TOOLS / "gpu_check.sh"), str(out)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    summary = json.loads((out / "summary.json").read_text())
    return proc, out, summary


def _statuses(summary: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in summary["stages"]}


def test_a_hanging_stage_is_stopped_at_its_limit_and_prints_its_stack(tmp_path):
    pid_file = tmp_path / "hang.pid"
    proc, out, summary = _check(
        tmp_path, STAGES="before,hang,after", LIMIT_hang="2", STACK_PERIOD="0.5",
        GPU_CHECK_STAGE_before=f"{sys.executable} -c 'print(\"before ran\")'",
        GPU_CHECK_STAGE_hang=f"{sys.executable} -c '{HANG}' {pid_file}",
        GPU_CHECK_STAGE_after="echo after ran")
    assert proc.returncode == 1, proc.stderr
    assert _statuses(summary) == {"before": "ok", "hang": "timeout", "after": "ok"}
    hang = summary["stages"][1]
    assert hang["limit_s"] == 2 and 2 <= hang["seconds"] < 4
    assert summary["check"]["exit_status"] == 1
    log = (out / "log.txt").read_text()
    # its stack while it ran (every STACK_PERIOD seconds) and once more when `timeout` sent SIGABRT at the limit
    assert log.count("Timeout (0:00:00.500000)!") >= 2 and "Fatal Python error: Aborted" in log
    assert log.count("in stuck_here") >= 3
    assert "before ran" in log and "after ran" in log and "== hang: timeout after 2." in log
    assert not Path(f"/proc/{pid_file.read_text()}").exists(), "the hung process outlived its stage"
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "report.md", "summary.json"]
    assert "| hang | timeout |" in (out / "report.md").read_text()


def test_a_failed_import_stops_the_check(tmp_path):
    proc, out, summary = _check(tmp_path, STAGES="env,after", REHEARSE="1", GPU_CHECK_REQUIRED="json no_such_module_x",
                                GPU_CHECK_STAGE_after="echo after ran")
    assert proc.returncode == 2
    assert _statuses(summary) == {"env": "failed", "after": "skipped"}
    env = summary["stages"][0]
    assert env["error"] == "no_such_module_x does not import" and env["versions"]["no_such_module_x"] == "FAILED"
    assert "after ran" not in (out / "log.txt").read_text()
    assert "environment failed" in summary["stages"][1]["note"] and summary["check"]["exit_status"] == 2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_no_cuda_device_stops_the_check(tmp_path):
    proc, out, summary = _check(tmp_path, STAGES="env,after", GPU_CHECK_REQUIRED="torch",
                                GPU_CHECK_STAGE_after="echo after ran")
    assert proc.returncode == 2 and _statuses(summary) == {"env": "failed", "after": "skipped"}
    assert summary["stages"][0]["error"].startswith("no CUDA device")
    assert "gpu_env.py: error: no CUDA device" in (out / "log.txt").read_text()


def test_the_budget_trims_a_limit_and_skips_what_no_longer_fits(tmp_path):
    proc, out, summary = _check(tmp_path, STAGES="slow,next", BUDGET="7", GPU_CHECK_STAGE_slow="sleep 30",
                                GPU_CHECK_STAGE_next="echo next ran")
    assert proc.returncode == 1
    assert _statuses(summary) == {"slow": "timeout", "next": "skipped"}
    assert summary["stages"][0]["limit_s"] in (3, 4)   # 7 s less 3 kept for the summary (less 1 if the clock ticked)
    assert "budget of 7 s spent" in summary["stages"][1]["note"]
    assert "next ran" not in (out / "log.txt").read_text()


def test_a_stage_cut_short_never_reports_an_earlier_runs_numbers(tmp_path):
    """Its folder under WORK/stages/ and its JSONL in OUT are new for every run of it."""
    _, _, first = _check(
        tmp_path, STAGES="train,step_syncs",
        GPU_CHECK_STAGE_train='mkdir "$STAGE_DIR/run" && echo \'{"mfu": 0.4}\' > "$STAGE_DIR/run/summary.json"',
        GPU_CHECK_STAGE_step_syncs='echo \'{"host_reads": 1}\' > "$out/step_syncs.jsonl"')
    assert first["stages"][0]["mfu"] == 0.4 and first["stages"][1]["rows"] == [{"host_reads": 1}]
    _, _, again = _check(tmp_path, STAGES="train,step_syncs", GPU_CHECK_STAGE_train="exit 1",
                         GPU_CHECK_STAGE_step_syncs="exit 1")
    assert again["stages"] == [{"name": "train", "status": "failed", "seconds": again["stages"][0]["seconds"],
                                "limit_s": 100.0},
                               {"name": "step_syncs", "status": "failed", "seconds": again["stages"][1]["seconds"],
                                "limit_s": 35.0, "rows": []}]


def test_an_unknown_stage_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(TOOLS / "gpu_check.sh"), str(out)], capture_output=True, text=True,
                          env={**os.environ, "STAGES": "env,nope", "WORK": str(tmp_path / "work")}, timeout=30)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown stage 'nope'" in proc.stderr
    assert not (out / "summary.json").exists()


def test_triton_keeps_the_first_autotune_candidates_when_asked(tmp_path):
    """GPU_CHECK_TRITON_CONFIGS=N (tools/gpu_check_site/sitecustomize.py): DeepSpeed's kernels autotune N candidates,
    not 6, so a cold cache compiles a sixth as much inside a stage's limit."""
    pytest.importorskip("triton")
    script = tmp_path / "kernel.py"   # @triton.jit reads its function's source: a file, not `python -c`
    script.write_text(
        "import triton\nimport triton.runtime.autotuner as autotuner\nseen = []\n"
        "init = autotuner.Autotuner.__init__\n"
        "autotuner.Autotuner.__init__ = lambda self, fn, names, configs, *a, **k: (seen.append(len(configs)), "
        "init(self, fn, names, configs, *a, **k))[1]\n"
        "@triton.autotune(configs=[triton.Config({'B': b}) for b in (16, 32, 64)], key=[])\n"
        "@triton.jit\ndef kernel(x):\n    pass\nprint(seen)\n")
    site = str(TOOLS / "gpu_check_site")
    for keep, seen in (("1", "[1]"), ("", "[3]")):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": site, "GPU_CHECK_TRITON_CONFIGS": keep,
                                   "GPU_CHECK_STACK_PERIOD": "0"})
        assert proc.returncode == 0 and proc.stdout.strip() == seen, proc.stderr
