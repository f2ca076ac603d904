"""The exchanges' all-to-all timer, peak memory, and the CPU peak: a real measurement, taken once per machine
and read from the cache after."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from types import SimpleNamespace

from moe_scale.metrics import perf
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


def test_cpu_peak_is_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path))
    peak, source = device_peak_tflops(torch.device("cpu"), half_precision=False)
    assert peak > 0 and source.startswith("measured float32 matmul on cpu on 20")
    (cached,) = (tmp_path / "peaks").iterdir()
    assert json.loads(cached.read_text())["tflops"] == peak


@pytest.fixture
def measurements(tmp_path, monkeypatch) -> list[torch.dtype]:
    """A temporary cache, and a matmul 'measurement' that returns a new number each time it runs."""
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path))
    taken = []

    def measure(device, dtype=torch.float32):
        taken.append(dtype)
        return 1.0 + len(taken)

    monkeypatch.setattr(perf, "measured_matmul_tflops", measure)
    monkeypatch.setattr(perf, "machine_busy", lambda: False)   # the tests say when the machine is busy
    return taken


def test_the_peak_is_measured_once_per_machine_then_read_back(measurements, tmp_path):
    cpu = torch.device("cpu")
    first = device_peak_tflops(cpu, False)
    assert first[0] == 2.0 and len(measurements) == 1
    (path,) = (tmp_path / "peaks").iterdir()
    assert first[1].startswith("measured float32 matmul on cpu on 20") and str(path) in first[1]
    assert device_peak_tflops(cpu, False) == first and len(measurements) == 1      # the next start: cached
    entry = json.loads(path.read_text())
    assert entry["key"] == perf.peak_cache_key(cpu, torch.float32, 1) and entry["tflops"] == 2.0
    assert entry["key"]["threads"] == torch.get_num_threads() and entry["key"]["torch"] == torch.__version__
    assert f"on {entry['measured']}, cached in" in first[1]


def test_another_key_is_measured_again(measurements, monkeypatch):
    cpu = torch.device("cpu")
    device_peak_tflops(cpu, False)
    assert device_peak_tflops(cpu, False, ranks_on_machine=2)[0] == 3.0     # two ranks share the machine
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert device_peak_tflops(cpu, False)[0] == 4.0                          # other threads
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert device_peak_tflops(cpu, False)[0] == 5.0                          # another torch
    monkeypatch.setattr(perf, "device_name", lambda device: "another CPU")
    assert device_peak_tflops(cpu, False)[0] == 6.0
    assert len(measurements) == 5


@pytest.mark.parametrize("content", ["", "{not json", "[]", '{"tflops": 2.0}', "null",
                                     '{"key": KEY, "tflops": -1.0, "measured": "x"}',
                                     '{"key": KEY, "tflops": "fast", "measured": "x"}',
                                     '{"key": KEY, "tflops": NaN, "measured": "x"}',
                                     '{"key": KEY, "tflops": 2.0}'])
def test_a_corrupt_cache_file_is_measured_again_and_replaced(measurements, content):
    cpu = torch.device("cpu")
    key = perf.peak_cache_key(cpu, torch.float32, 1)
    path = perf.peak_cache_path(key)
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("KEY", json.dumps(key)))
    assert device_peak_tflops(cpu, False)[0] == 2.0 and len(measurements) == 1
    assert perf.cached_peak(key)[0] == 2.0                                   # written over, readable again
    assert device_peak_tflops(cpu, False)[0] == 2.0 and len(measurements) == 1


def test_an_unwritable_cache_is_a_warning_and_the_number_still_comes(measurements, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("MOE_SCALE_CACHE", str(blocker))
    assert device_peak_tflops(torch.device("cpu"), False)[0] == 2.0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe-scale: warning: the measured matmul peak is not cached")


def test_every_rank_measures_when_one_misses_the_cache(measurements):
    """The ranks agree (all_found, an all-reduce MIN in the trainer): one rank's miss makes all measure at once,
    so processes sharing cores still each time their share."""
    cpu = torch.device("cpu")
    device_peak_tflops(cpu, False)
    assert device_peak_tflops(cpu, False, all_found=lambda found: False)[0] == 3.0 and len(measurements) == 2
    asked = []
    device_peak_tflops(cpu, False, all_found=lambda found: asked.append(found) or found)
    assert asked == [True]


def test_a_run_that_beats_its_measured_peak_raises_it(measurements, tmp_path):
    """MFU over 100% means the cached peak was measured on a busier machine: the run's own rate becomes the peak,
    cached for the next start (no measurement); a peak that held, or a table peak, stays."""
    cpu = torch.device("cpu")
    peak, _ = device_peak_tflops(cpu, False)
    (path,) = (tmp_path / "peaks").iterdir()
    assert perf.raised_peak(cpu, False, 1, peak, 0.9 * peak) is None
    assert perf.raised_peak(cpu, False, 1, peak, 1.5 * peak, store=False)[0] == 1.5 * peak
    assert device_peak_tflops(cpu, False)[0] == peak                                 # not stored: unchanged
    raised, source = perf.raised_peak(cpu, False, 1, peak, 1.5 * peak)
    assert raised == 1.5 * peak and "exceeded the measured 2 TFLOPS" in source and str(path) in source
    assert device_peak_tflops(cpu, False)[0] == 1.5 * peak and len(measurements) == 1   # the cache's, not measured
    gpu = torch.device("cuda", 0)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(perf, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
        assert perf.raised_peak(gpu, True, 1, 989.4, 2000.0) is None                 # the table's peak stays


def test_a_peak_measured_on_a_busy_machine_is_measured_again_once_it_is_not(measurements, monkeypatch):
    """The issue's cache: measured under load (2.7x low), it later read 'MFU 87%' on an idle machine. Measured
    busy, it is kept while the machine stays busy, measured again once it is not, and the higher kept."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(perf, "machine_busy", lambda: True)
    assert device_peak_tflops(cpu, False)[0] == 2.0 and device_peak_tflops(cpu, False)[0] == 2.0
    assert len(measurements) == 1                                            # still busy: read back
    monkeypatch.setattr(perf, "machine_busy", lambda: False)
    assert device_peak_tflops(cpu, False)[0] == 3.0 and len(measurements) == 2   # quiet: measured again
    assert device_peak_tflops(cpu, False)[0] == 3.0 and len(measurements) == 2   # and kept
    key = perf.peak_cache_key(cpu, torch.float32, 1)
    perf.store_peak(key, 9.0, busy=True)                                     # busy, and higher than a new one:
    assert device_peak_tflops(cpu, False)[0] == 9.0 and len(measurements) == 3   # the higher stays
