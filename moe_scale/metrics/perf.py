"""Per-interval efficiency: MFU against a device's peak, and the share of step time spent in all-to-all.

Peak: a table of dense matmul peaks keyed by GPU name (bf16/fp16 when the run trains in half precision,
else fp32). On CPU, and on a GPU missing from the table, the peak is measured once per machine: the best of a
few large matmuls, on every rank at the same time (so processes sharing cores each see their share), kept in
$MOE_SCALE_CACHE/peaks/ (default ~/.cache/moe_scale/peaks) under a key of what it depends on (device, dtype,
torch version, threads, ranks on the machine). Timed again at every start, it swung with whatever else ran:
one run's MFU read 1% to 36% on a busy machine. The source string says which peak, and when it was measured;
a run that beats a measured peak raises it to its own rate, in the cache too (raised_peak): no MFU over 100% is printed
or saved. A peak measured while the machine was busy (its load average above its cores, kept with the peak) is
measured again at the first start on a machine that is not, and the higher of the two kept: a peak cached under
load read 2.7x low, and an idle run's MFU then read 87%.

All-to-all time: every exchange times its all-to-all calls (moe/dispatch/exchange.py), forward and backward; the
time includes waiting for the slowest rank of the expert-parallel group, which is what a user pays.
Peak memory: the process's peak resident set.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from moe_scale.data.embedded import cache_root
from moe_scale.files import write_json_atomic

# Dense matmul peaks in TFLOPS (vendor datasheets, without sparsity): (name substring, bf16/fp16, tf32, fp32).
# float32 runs read TF32's where torch's float32 matmul precision allows it (train sets "high" on CUDA) and the
# GPU has it; None: no TF32 units, or no sourced figure. First match wins, so the more specific names come first.
PEAK_TFLOPS = [
    ("H100 PCIe", 756.0, 378.0, 51.2),
    ("GH200", 989.4, 494.7, 66.9),
    ("H200", 989.4, 494.7, 66.9),
    ("H100", 989.4, 494.7, 66.9),        # SXM
    ("B200", 2250.0, 1100.0, 75.0),
    ("A100", 312.0, 156.0, 19.5),
    ("L40S", 362.0, 183.0, 91.6),
    ("V100", 125.0, None, 15.7),
    ("A10G", 70.0, None, 31.2),
    ("L4", 121.0, None, 30.3),
    ("K40", 4.29, None, 4.29),          # the paper's GPU (no half-precision units)
]


# Memory bandwidth in GB/s (datasheets), same matching rule.
PEAK_GBS = [
    ("H100 PCIe", 2000.0),
    ("H200", 4800.0),
    ("H100", 3350.0),             # SXM
    ("A100-SXM4-40GB", 1555.0),
    ("A100-PCIE-40GB", 1555.0),
    ("A100", 2039.0),             # 80 GB SXM
    ("V100", 900.0),
]


def table_peak_gbs(device_name: str) -> float | None:
    return next((gbs for key, gbs in PEAK_GBS if key.lower() in device_name.lower()), None)


def tf32_matmuls() -> bool:
    """Whether float32 matmuls may run as TF32 on CUDA (torch.set_float32_matmul_precision "high" or "medium")."""
    return torch.get_float32_matmul_precision() != "highest"


def table_peak_tflops(device_name: str, half_precision: bool, tf32: bool | None = None) -> float | None:
    """The table's peak for this GPU: bf16/fp16, else TF32 where `tf32` (default: torch's current setting) and the
    GPU has it, else fp32; None for a GPU not in the table."""
    tf32 = tf32_matmuls() if tf32 is None else tf32
    for key, half, tensor_f32, single in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return half if half_precision else (tensor_f32 if tf32 and tensor_f32 else single)
    return None


def measured_matmul_tflops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                           repeats: int = 5) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):          # the first call warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - began)
    return 2 * n ** 3 / best / 1e12


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model (/proc/cpuinfo's "model name", else what platform knows)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_cache_key(device: torch.device, dtype: torch.dtype, ranks_on_machine: int) -> dict:
    """What a measured peak depends on; under a different key it is measured again."""
    return {"device": f"{device.type}: {device_name(device)}", "dtype": str(dtype).replace("torch.", ""),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "ranks_on_machine": ranks_on_machine}


def peak_cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "peaks" / f"{digest}.json"


def machine_busy() -> bool:
    """Whether more processes run than this machine has cores (the 1-minute load average; False where unknown)."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return False


def cached_peak(key: dict, busy_now: bool | None = None) -> tuple[float, str] | None:
    """(TFLOPS, when measured) from the cache, or None: no file, or one that is unreadable, of another key or
    without a positive number, or one measured while the machine was busy when it is not now (`busy_now`; None:
    asked of the machine); then it is measured again and the higher kept."""
    try:
        entry = json.loads(peak_cache_path(key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("measured"), str):
        return None
    tflops = entry.get("tflops")
    if isinstance(tflops, bool) or not isinstance(tflops, (int, float)) or not math.isfinite(tflops) or tflops <= 0:
        return None
    if entry.get("busy") is True and not (machine_busy() if busy_now is None else busy_now):
        return None
    return float(tflops), entry["measured"]


def busy_cached_tflops(key: dict) -> float:
    """The cached number where it was measured on a busy machine (0: none, or not measured busy)."""
    try:
        entry = json.loads(peak_cache_path(key).read_text())
        tflops = float(entry["tflops"]) if entry.get("key") == key and entry.get("busy") is True else 0.0
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return 0.0
    return tflops if math.isfinite(tflops) and tflops > 0 else 0.0


def store_peak(key: dict, tflops: float, busy: bool | None = None) -> str:
    """Caches a measurement (whole or not at all) with whether the machine was busy (`busy`; None: asked of it);
    returns its date. A cache that cannot be written is a warning: the run goes on with the number."""
    measured = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    path = peak_cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"key": key, "tflops": tflops, "measured": measured,
                                 "busy": machine_busy() if busy is None else busy})
    except OSError as e:
        print(f"moe-scale: warning: the measured matmul peak is not cached ({path}: {e.strerror or e}; set "
              f"MOE_SCALE_CACHE); the next start measures it again", file=sys.stderr)
    return measured


def device_peak_tflops(device: torch.device, half_precision: bool, ranks_on_machine: int = 1,
                       all_found: Callable[[bool], bool] = lambda found: found) -> tuple[float, str]:
    """(peak TFLOPS of one device, where the number comes from: the table, or a measurement, its date and its
    cache file). `all_found(found)`: whether every rank found its peak in the cache (several ranks: an
    all-reduce), so that either all read it or all measure at the same time."""
    name = device_name(device)
    table = table_peak_tflops(name, half_precision) if device.type == "cuda" else None
    key = _measured_peak_key(device, half_precision, ranks_on_machine)
    cached = None if table is not None else cached_peak(key)
    if all_found(table is not None or cached is not None):   # asked on every path: a collective on every rank
        if table is not None:
            return table, f"table: {name}, {_table_precision(name, half_precision)}"
        tflops, measured = cached
    else:
        # (a peak measured under load and now measured again on a quieter machine: the higher of the two)
        tflops = max(measured_matmul_tflops(device, getattr(torch, key["dtype"])), busy_cached_tflops(key))
        measured = store_peak(key, tflops)
    return tflops, (f"measured {key['dtype']} matmul on {device.type} on {measured}, cached in "
                    f"{peak_cache_path(key)}; delete the file to measure again")


def _table_precision(name: str, half_precision: bool) -> str:
    if half_precision:
        return "bf16/fp16"
    return "tf32" if table_peak_tflops(name, False) != table_peak_tflops(name, False, tf32=False) else "fp32"


def _measured_peak_key(device: torch.device, half_precision: bool, ranks_on_machine: int) -> dict:
    dtype = torch.bfloat16 if half_precision and device.type == "cuda" else torch.float32
    return peak_cache_key(device, dtype, ranks_on_machine)


def raised_peak(device: torch.device, half_precision: bool, ranks_on_machine: int, peak_tflops: float,
                achieved_tflops: float, store: bool = True) -> tuple[float, str] | None:
    """A measured peak that a run beats (MFU over 100%) was measured while the machine was busier: the run's own
    rate is the better measurement, so it becomes the peak from now on, and the cache's (`store`: the rank that
    writes it). Returns (the new peak, where it comes from), or None: a table peak, or one not exceeded."""
    if device.type == "cuda" and table_peak_tflops(device_name(device), half_precision) is not None:
        return None
    if not achieved_tflops > peak_tflops:
        return None
    key = _measured_peak_key(device, half_precision, ranks_on_machine)
    when = store_peak(key, achieved_tflops) if store else "now"
    return achieved_tflops, (f"this run's own rate on {when}: it exceeded the measured {peak_tflops:.4g} TFLOPS, "
                             f"measured while the machine was busier; cached in {peak_cache_path(key)}")


def all_to_all_seconds(moe_layers) -> float:
    """Seconds the layers' exchanges have spent in all-to-all calls so far (moe/dispatch/exchange.py's CommTimer:
    counts and rows, forward and backward, including the wait for the slowest rank of the group)."""
    return sum(layer.dispatcher.timer.seconds for layer in moe_layers)


def peak_rss_mib() -> float:
    """This process's peak resident set size. Linux: VmHWM of /proc/self/status (getrusage's ru_maxrss would
    carry over the peak of the process that exec'ed us, e.g. a launcher); elsewhere ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def efficiency(tflops_per_device: float, peak_tflops: float, all_to_all_seconds: float,
               step_seconds_total: float) -> dict[str, float]:
    """MFU and all-to-all share of the timed steps (NaN before any step was timed)."""
    if not step_seconds_total:
        return {"mfu": float("nan"), "all_to_all_share": float("nan")}
    return {"mfu": tflops_per_device / peak_tflops, "all_to_all_share": all_to_all_seconds / step_seconds_total}
