"""Per-interval efficiency: MFU against a device's peak, and the share of step time spent in all-to-all.

Peak: a table of dense matmul peaks keyed by GPU name (bf16/fp16 when the run trains in half precision,
else fp32). On CPU, and on a GPU missing from the table, the peak is measured once per run: the best of
a few large matmuls, on every rank at the same time (so processes sharing cores each see their share).

All-to-all time: the dispatcher's token all-to-all (`moe.dispatch._all_to_all`) is wrapped at run time
by a timing shim, forward and backward (the backward exchange is timed between two autograd marks around
it). The time includes waiting for the slowest rank of the expert-parallel group, which is what a user
pays. The small per-expert count exchange is not included.
"""

from __future__ import annotations

import time

import torch

# Dense matmul peaks in TFLOPS (vendor datasheets, without sparsity): (name substring, bf16/fp16, fp32).
# First match wins, so the more specific names come first.
PEAK_TFLOPS = [
    ("H100 PCIe", 756.0, 51.2),
    ("H200", 989.4, 66.9),
    ("H100", 989.4, 66.9),        # SXM
    ("A100", 312.0, 19.5),
    ("V100", 125.0, 15.7),
    ("A10G", 70.0, 31.2),
    ("L4", 121.0, 30.3),
    ("K40", 4.29, 4.29),          # the paper's GPU (no half-precision units)
]


def table_peak_tflops(device_name: str, half_precision: bool) -> float | None:
    for key, half, single in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return half if half_precision else single
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


def device_peak_tflops(device: torch.device, half_precision: bool) -> tuple[float, str]:
    """(peak TFLOPS of one device, where the number comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak_tflops(name, half_precision)
        if peak is not None:
            return peak, f"table: {name}"
    dtype = torch.bfloat16 if half_precision and device.type == "cuda" else torch.float32
    return measured_matmul_tflops(device, dtype), f"measured {str(dtype).replace('torch.', '')} matmul on {device.type}"


class _BackwardStart(torch.autograd.Function):
    """Identity; its backward runs just before the all-to-all's backward and starts the clock."""

    @staticmethod
    def forward(ctx, x, timer):
        ctx.timer = timer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer.backward_began = time.perf_counter()
        return grad, None


class _BackwardEnd(torch.autograd.Function):
    """Identity; its backward runs just after the all-to-all's backward and stops the clock."""

    @staticmethod
    def forward(ctx, x, timer):
        ctx.timer = timer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.timer.backward_began is not None:
            ctx.timer.seconds += time.perf_counter() - ctx.timer.backward_began
            ctx.timer.backward_began = None
        return grad, None


class AllToAllTimer:
    """Seconds spent in the dispatcher's all-to-all since the last `take()`."""

    def __init__(self):
        self.seconds = 0.0
        self.backward_began: float | None = None
        self._original = None

    def install(self) -> "AllToAllTimer":
        from moe_scale.moe import dispatch

        original = self._original = dispatch._all_to_all
        timer = self

        def timed_all_to_all(rows, out_splits, in_splits, group):
            if rows.requires_grad:
                rows = _BackwardEnd.apply(rows, timer)
            _sync(rows)
            began = time.perf_counter()
            out = original(rows, out_splits, in_splits, group)
            _sync(out)
            timer.seconds += time.perf_counter() - began
            return _BackwardStart.apply(out, timer) if out.requires_grad else out

        dispatch._all_to_all = timed_all_to_all
        return self

    def uninstall(self) -> None:
        if self._original is not None:
            from moe_scale.moe import dispatch

            dispatch._all_to_all = self._original
            self._original = None

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def efficiency(tflops_per_device: float, peak_tflops: float, all_to_all_seconds: float,
               step_seconds_total: float) -> dict[str, float]:
    """MFU and all-to-all share of the timed steps (NaN before any step was timed)."""
    if not step_seconds_total:
        return {"mfu": float("nan"), "all_to_all_share": float("nan")}
    return {"mfu": tflops_per_device / peak_tflops, "all_to_all_share": all_to_all_seconds / step_seconds_total}
