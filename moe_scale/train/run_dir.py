"""The run directory: what a run writes and where.

    config.json       resolved run configuration (reload with --config)
    ds_config.json    the DeepSpeed JSON as used (batch keys filled in)
    vocab             one word per line
    train_log.jsonl   one record per optimizer step (loss, aux loss, lr)
    summary.json      final numbers
    tb/               TensorBoard events
    checkpoints/      DeepSpeed checkpoints; checkpoints/complete names the newest complete one
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from moe_scale.errors import UserError

RUN_FILES = ("config.json", "summary.json", "checkpoints", "train_log.jsonl")


def check_run_dir(out: str, resume: bool, overwrite: bool) -> Path:
    """All checks on --out, writing nothing (so a bad flag elsewhere leaves no half-made run)."""
    run = Path(out)
    if run.exists() and not run.is_dir():
        raise UserError(f"--out {out} exists and is not a directory; choose another --out")
    has_run = run.is_dir() and any((run / name).exists() for name in RUN_FILES)
    if resume and not (run / "checkpoints" / "complete").exists():
        raise UserError(f"--resume: no complete checkpoint in {out}/checkpoints; start without --resume")
    if has_run and not (resume or overwrite):
        raise UserError(f"--out {out} already holds a run; pass --resume to continue it, --overwrite to "
                        f"replace it, or choose another --out")
    _check_writable(run)
    return run


def create_run_dir(run: Path, resume: bool, overwrite: bool) -> None:
    """On the writer rank, once every input has been checked."""
    if overwrite and not resume and run.is_dir():
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)


def _check_writable(run: Path) -> None:
    probe = run
    while not probe.exists():
        probe = probe.parent
    problem = f"--out {run}: cannot create files in {probe}; choose a writable --out"
    if not probe.is_dir():
        raise UserError(f"--out {run}: {probe} is a file, not a directory; choose another --out")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError:
        raise UserError(problem)


def write_json_atomic(path: Path, data) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(f.name, path)
