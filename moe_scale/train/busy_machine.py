"""A CPU run that other processes slow down says so, once, with what to do.

At a log point, where the machine is busy (its 1-minute load average above its cores, metrics/perf.py), a short
matmul is timed against the peak this machine measured: where it runs at under half of that, other processes are
taking this run's cores, and one line says so with the numbers and the remedy. On a 2-core machine beside 3 spinning
processes the default LSTM-MoE ran 12x slower than idle with torch's 2 threads (docs/clusters.md#a-busy-machine).
"""

from __future__ import annotations

import math
import os
import time

import torch

from moe_scale.metrics.perf import machine_busy

SLOW = 0.5   # a matmul below this share of the measured peak: the cores are not this run's
EVERY_S = 60.0   # at most one probe a minute (a log point is often more frequent)


class BusyMachineNotice:
    def __init__(self, device: torch.device, peak_tflops: float, measured_peak: bool):
        """`measured_peak`: the peak was measured on this machine (a table peak is a GPU's: nothing to say)."""
        self.active = device.type == "cpu" and measured_peak and peak_tflops > 0
        self.device, self.peak_tflops = device, peak_tflops
        self.probed_at = -math.inf

    def check(self, tokens_per_s: float) -> str | None:
        """The line to print (once), or None. Free unless the load average is above the cores; then about 25 ms
        of matmuls, at most once a minute."""
        if not self.active or not math.isfinite(tokens_per_s) or time.monotonic() - self.probed_at < EVERY_S \
                or not machine_busy():
            return None
        self.probed_at = time.monotonic()
        now = matmul_rate(self.device)
        if now >= SLOW * self.peak_tflops:
            return None
        self.active = False
        load = os.getloadavg()[0]
        return (f"moe-scale: note: this machine is busy (load average {load:.1f} on {os.cpu_count()} cores): a "
                f"matmul runs at {now / self.peak_tflops:.0%} of the rate this machine measured "
                f"({now:.3g} of {self.peak_tflops:.3g} TFLOPS) and this interval trained {tokens_per_s:.0f} "
                f"tokens/s; stop the other processes, or give this run fewer threads while they run "
                f"(OMP_NUM_THREADS=1; it has {torch.get_num_threads()})")


def matmul_rate(device: torch.device, n: int = 512, products: int = 4) -> float:
    """TFLOPS of `products` [n, n] float32 products in a row, after one to warm up: their total time, not the best
    one's (a best of a few short ones finds the moment another process was off the core; a run gets the total)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    torch.mm(a, b)
    began = time.perf_counter()
    for _ in range(products):
        torch.mm(a, b)
    return products * 2 * n ** 3 / (time.perf_counter() - began) / 1e12
