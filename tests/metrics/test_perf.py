"""The all-to-all timing shim times the exchange forward and backward; the CPU peak is a real measurement."""

from __future__ import annotations

import time

import pytest
import torch

from moe_scale.metrics.perf import AllToAllTimer, device_peak_tflops
from moe_scale.moe import dispatch

DELAY = 0.05


class _SlowExchange(torch.autograd.Function):
    """Stands in for the all-to-all: takes DELAY seconds forward and DELAY seconds backward."""

    @staticmethod
    def forward(ctx, rows):
        time.sleep(DELAY)
        return rows * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(DELAY)
        return grad


def test_timer_counts_forward_and_backward_exchange_only(monkeypatch):
    monkeypatch.setattr(dispatch, "_all_to_all", lambda rows, out_splits, in_splits, group: _SlowExchange.apply(rows))
    timer = AllToAllTimer().install()
    try:
        x = torch.randn(8, 4, requires_grad=True)
        y = dispatch._all_to_all(x * 2, [8], [8], None)
        time.sleep(DELAY)                       # work outside the exchange is not counted
        (y.sum() * 3).backward()
        seconds = timer.take()
    finally:
        timer.uninstall()
    assert 2 * DELAY <= seconds < 3 * DELAY
    assert timer.take() == 0.0
    assert torch.equal(x.grad, torch.full_like(x, 6.0))      # the marks are identities for autograd
    assert dispatch._all_to_all is not None and getattr(dispatch._all_to_all, "__name__", "") == "<lambda>"


def test_cpu_peak_is_measured():
    peak, source = device_peak_tflops(torch.device("cpu"), half_precision=False)
    assert peak > 0 and source.startswith("measured float32 matmul")
