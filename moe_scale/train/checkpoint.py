"""Checkpoints: DeepSpeed's format (one file per global expert, optimizer shards per rank), plus a marker.

`checkpoints/complete` is written by rank 0 only after every rank has finished writing, so a run killed
mid-save resumes from the previous complete checkpoint. Data position and random streams are functions of
the step number, so the step is all the loop itself needs back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist

from moe_scale.train.run_dir import write_json_atomic

KEEP_LAST = 2


def save_checkpoint(engine, run: Path, step: int, rank: int) -> None:
    directory = run / "checkpoints"
    tag = f"step{step:08d}"
    engine.save_checkpoint(str(directory), tag=tag, client_state={"step": step}, save_latest=False)
    dist.barrier()
    if rank == 0:
        write_json_atomic(directory / "complete", {"tag": tag, "step": step})
        tags = sorted(p.name for p in directory.glob("step*") if p.is_dir())
        for old in tags[:-KEEP_LAST]:
            shutil.rmtree(directory / old, ignore_errors=True)
    dist.barrier()


def load_checkpoint(engine, run: Path) -> int:
    """Restore the newest complete checkpoint; returns the number of steps already done."""
    directory = run / "checkpoints"
    marker = json.loads((directory / "complete").read_text())
    _, client_state = engine.load_checkpoint(str(directory), tag=marker["tag"])
    return int(client_state["step"])
