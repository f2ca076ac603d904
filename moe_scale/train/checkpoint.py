"""Checkpoints: DeepSpeed's format (one file per global expert, optimizer shards per rank), plus a marker.

`checkpoints/complete` is written by rank 0 only after every rank has finished writing, so a run killed
mid-save resumes from the previous complete checkpoint. Random streams, and the in-memory data position,
are functions of the step number; a streamed data source (`--stream`) also saves its position, one file
per rank (`data_stream_rank<r>.pt` in the checkpoint's directory), so a resumed run reads on exactly
where it stopped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from moe_scale.errors import UserError

from moe_scale.files import write_json_atomic

KEEP_LAST = 2


def save_checkpoint(engine, run: Path, step: int, rank: int, data_source=None) -> None:
    directory = run / "checkpoints"
    tag = f"step{step:08d}"
    engine.save_checkpoint(str(directory), tag=tag, client_state={"step": step}, save_latest=False)
    if hasattr(data_source, "state_dict"):
        _save_stream_state(directory / tag / f"data_stream_rank{rank}.pt", data_source.state_dict())
    dist.barrier()
    if rank == 0:
        write_json_atomic(directory / "complete", {"tag": tag, "step": step})
        tags = sorted(p.name for p in directory.glob("step*") if p.is_dir())
        for old in tags[:-KEEP_LAST]:
            shutil.rmtree(directory / old, ignore_errors=True)
    dist.barrier()


def latest_complete_tag(run: Path) -> str | None:
    """The tag the marker names, or None (no complete checkpoint, or an unreadable marker)."""
    try:
        return json.loads((run / "checkpoints" / "complete").read_text())["tag"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_checkpoint(engine, run: Path, data_source=None) -> int:
    """Restore the newest complete checkpoint; returns the number of steps already done."""
    directory = run / "checkpoints"
    marker = json.loads((directory / "complete").read_text())
    _, client_state = engine.load_checkpoint(str(directory), tag=marker["tag"])
    step = int(client_state["step"])
    if hasattr(data_source, "load_state_dict"):
        rank = dist.get_rank() if dist.is_initialized() else 0
        path = directory / marker["tag"] / f"data_stream_rank{rank}.pt"
        if not path.is_file():
            raise UserError(f"{path} is missing: checkpoint {marker['tag']} was not written by a streamed run "
                            "with this many processes; resume without --stream, or with the original layout")
        state = torch.load(path, weights_only=False)
        if state["step"] != step:
            raise UserError(f"{path} is at step {state['step']} but the checkpoint at step {step}; "
                            "the checkpoint directory is inconsistent, start a new run")
        data_source.load_state_dict(state)
    return step


def _save_stream_state(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
