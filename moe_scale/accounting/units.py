"""Numbers as the planner prints and reads them: times in the unit that shows them (s, ms, µs, ns), long durations
in minutes, hours or days, and counts with a suffix (--tokens 1B)."""

from __future__ import annotations

import math

from moe_scale.errors import UserError

# Suffixes of a count: thousand, million, billion (B or G) and trillion; case-insensitive.
COUNT_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def seconds_text(seconds: float) -> str:
    """A time of a step or part of one, four significant digits in the largest unit under it: 1.234 s, 12.35 ms,
    123.5 µs, 0 s."""
    if seconds == 0:
        return "0 s"
    if not math.isfinite(seconds):
        return f"{seconds} s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            value = seconds / scale
            return f"{value:,.0f} {unit}" if value >= 1e4 else f"{value:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"


def duration_text(seconds: float) -> str:
    """A wall time: seconds below two minutes (seconds_text), then minutes, hours, days (3 significant digits)."""
    if not math.isfinite(seconds) or seconds < 120:
        return seconds_text(seconds)
    for unit, scale in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * scale or unit == "min":
            value = seconds / scale
            return f"{value:,.0f} {unit}" if value >= 1000 else f"{value:.3g} {unit}"
    raise AssertionError("unreachable")


def parse_count(text: str, flag: str) -> int:
    """A positive count: digits (1000000, 1_000_000, 1e9) or a number with a suffix k, M, B (or G), T: 100M, 1.5B."""
    raw = text.strip().replace("_", "").replace(",", "")
    scale = COUNT_SUFFIXES.get(raw[-1:].lower(), 1.0) if raw and raw[-1].isalpha() else 1.0
    number = raw[:-1] if scale != 1.0 else raw
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise UserError(f"{flag} {text}: give a positive count of tokens, e.g. 1000000, 100M, 1.5B or 2T")
    return round(value)


def count_text(n: float) -> str:
    """1.5B, 100M, 12k, 999."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:.4g}"
