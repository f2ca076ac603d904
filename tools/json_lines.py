"""JSON output shared by the benchmarks in tools/: one row per line on stdout, and appended to --out (`emit`); or
one report, indented, on stdout and in --out (`emit_report`)."""

from __future__ import annotations

import json
from pathlib import Path


def emit(row: dict, out: Path | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(line + "\n")


def emit_report(report: dict, out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


def sig(x: float) -> float:
    """x to 4 significant digits: measured times carry no more."""
    return float(f"{x:.4g}")
