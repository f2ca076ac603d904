"""The exchanges' all-to-all timer, peak memory, and the CPU peak as a real measurement."""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from types import SimpleNamespace

from moe_scale.metrics.perf import all_to_all_seconds, device_peak_tflops
from moe_scale.moe.dispatch.exchange import CommTimer

DELAY = 0.05


def test_comm_timer_counts_only_the_calls_it_runs():
    timer = CommTimer()
    assert timer.run(lambda: time.sleep(DELAY) or 7, torch.device("cpu")) == 7
    time.sleep(DELAY)                             # work outside the exchange is not counted
    assert DELAY <= timer.seconds < 2 * DELAY and timer.calls == 1
    layers = [SimpleNamespace(dispatcher=SimpleNamespace(timer=timer))] * 2
    assert all_to_all_seconds(layers) == 2 * timer.seconds
    timer.reset()
    assert (timer.seconds, timer.calls) == (0.0, 0)


def test_peak_rss_grows_with_a_large_allocation():
    code = ("import torch; from moe_scale.metrics.perf import peak_rss_mib; before = peak_rss_mib(); "
            "block = torch.ones(64 * 2**20); print(before, peak_rss_mib())")   # 256 MiB, touched
    before, after = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                              check=True).stdout.split())
    assert 200 <= after - before <= 300


def test_cpu_peak_is_measured():
    peak, source = device_peak_tflops(torch.device("cpu"), half_precision=False)
    assert peak > 0 and source.startswith("measured float32 matmul")
