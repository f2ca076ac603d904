"""Where a step's time and memory go: all-to-all seconds of the MoE layers, and peak resident memory."""

from __future__ import annotations

import resource
import sys


def all_to_all_seconds(moe_layers) -> float:
    """Seconds the layers' exchanges have spent in all-to-all calls so far (forward and backward)."""
    return sum(layer.dispatcher.exchange.timer.seconds for layer in moe_layers)


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024
