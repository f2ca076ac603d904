"""JSON-lines output shared by the benchmarks in tools/: one row per line on stdout, and appended to --out."""

from __future__ import annotations

import json
from pathlib import Path


def emit(row: dict, out: Path | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(line + "\n")


def sig(x: float) -> float:
    """x to 4 significant digits: measured times carry no more."""
    return float(f"{x:.4g}")
