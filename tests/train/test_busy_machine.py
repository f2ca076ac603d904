"""A CPU run slowed by other processes says so once, with the numbers and the remedy
(moe_scale/train/busy_machine.py): under a real load (spinning processes) the matmul probe falls below half of an
idle measurement and the notice speaks; on a quiet machine it stays silent; a training run prints it once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from moe_scale.train import busy_machine
from moe_scale.train.busy_machine import BusyMachineNotice, matmul_rate
from tests.cli_runs import TINY, run_cli

CPU = torch.device("cpu")


def test_a_real_load_slows_the_probe_and_the_notice_says_so_once(monkeypatch):
    monkeypatch.setattr(busy_machine, "machine_busy", lambda: True)   # the load average lags by a minute
    idle = max(matmul_rate(CPU) for _ in range(3))
    assert BusyMachineNotice(CPU, idle / 4, True).check(1000.0) is None   # not slow against this peak
    spinner = [sys.executable, "-S", "-c", "while True: pass"]   # -S: no site import, spinning at once
    spinners = [subprocess.Popen(spinner) for _ in range(4 * os.cpu_count())]
    try:
        time.sleep(0.3)
        notice = BusyMachineNotice(CPU, idle, True)
        line = notice.check(1234.0)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert line is not None and line.startswith("moe-scale: note: this machine is busy (load average ")
    assert "of the rate this machine measured" in line and "trained 1234 tokens/s" in line
    assert line.endswith(f"(OMP_NUM_THREADS=1; it has {torch.get_num_threads()})")
    assert notice.check(1234.0) is None   # once


def test_nothing_is_said_on_a_quiet_machine_a_gpu_or_before_the_rate_is_timed(monkeypatch):
    probes = []
    monkeypatch.setattr(busy_machine, "matmul_rate", lambda *a, **k: probes.append(1) or 0.0)
    monkeypatch.setattr(busy_machine, "machine_busy", lambda: False)
    assert BusyMachineNotice(CPU, 1.0, True).check(10.0) is None and probes == []   # the load average: free
    monkeypatch.setattr(busy_machine, "machine_busy", lambda: True)
    assert BusyMachineNotice(CPU, 1.0, False).check(10.0) is None             # a table peak: nothing measured
    assert BusyMachineNotice(CPU, 1.0, True).check(float("nan")) is None       # the warm-up's interval
    notice = BusyMachineNotice(CPU, 1.0, True)
    monkeypatch.setattr(busy_machine, "matmul_rate", lambda *a, **k: probes.append(1) or 0.9)
    assert notice.check(10.0) is None and notice.check(10.0) is None and probes == [1]   # at most once a minute


def busy_train(argv: list[str]) -> int:
    """`moe-scale train` on a machine whose matmuls run at a tenth of its measured peak."""
    from moe_scale.cli import main

    busy_machine.machine_busy = lambda: True
    busy_machine.matmul_rate = lambda device: 1e-12
    return main(argv)


def test_a_training_run_prints_the_notice_once(tmp_path, embedded_cache):
    proc = run_cli("train", *TINY, "--max-steps", "8", "--log-interval", "1", "--eval-interval", "8",
                   "--checkpoint-interval", "0", "--out", str(tmp_path / "run"), cwd=tmp_path, cache=embedded_cache,
                   entry=busy_train, check=True)
    notes = [line for line in proc.stderr.splitlines() if line.startswith("moe-scale: note: this machine is busy")]
    assert len(notes) == 1, proc.stderr
