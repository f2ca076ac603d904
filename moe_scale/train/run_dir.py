"""The run directory: what a run writes and where, and the rules that keep it from touching anything else.

    moe_scale_run.json  marker: this directory holds a moe_scale run (written first)
    lock                host and PID of the live run writing here (removed when it ends)
    config.json         resolved run configuration (reload with --config)
    ds_config.json      the DeepSpeed JSON as used (batch keys filled in)
    data_files.json     each data file's size and fingerprint (a resume on changed text is refused)
    vocab               one word per line (vocab.counts: the training counts); word runs
    tokenizer.json      the BPE or --tokenizer file (ids 0-2: <UNK> <S> </S>); subword runs
    train_log.jsonl     one record per optimizer step (loss, aux loss, lr)
    summary.json        final numbers
    tb/                 TensorBoard events
    checkpoints/        DeepSpeed checkpoints; checkpoints/complete names the newest complete one
    pruning/            `moe-scale prune-heads` reports
    expert_load.jsonl   per logging interval: each MoE layer's load per expert / mean load
    plots/              loss and perplexity curves, expert-load heatmaps; `eval --expert-stats` charts

`--overwrite` deletes only these entries, only in a directory that holds a run, only when every entry there
is one of them, and never while the run's lock is live.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from moe_scale.errors import UserError
from moe_scale.files import is_partial_write, write_json_atomic
from moe_scale.run_files import RunFiles
from moe_scale.train.run_lock import LOCK_NAME, RunLock, live_owner

MARKER = RunFiles.MARKER
RUN_FILES = (RunFiles.CONFIG, RunFiles.SUMMARY, RunFiles.CHECKPOINTS, RunFiles.TRAIN_LOG)   # any: a run is here
OWNED = frozenset(RunFiles.ALL)


def _owned(name: str) -> bool:
    """Our files, and what a write killed half-way leaves (moe_scale/files.py)."""
    return name in OWNED or is_partial_write(name)


def check_run_dir(out: str, resume: bool, overwrite: bool, resume_from: str | None = None) -> Path:
    """All checks on --out, writing nothing (so a bad flag elsewhere leaves no half-made run)."""
    if not out.strip():
        raise UserError("--out is empty; name the run directory, e.g. --out runs/lstm-moe")
    run = Path(out)
    if run.is_symlink() and not run.exists():
        raise UserError(f"--out {out} is a symbolic link to {os.readlink(run)}, which does not exist; create that "
                        f"directory first, or choose another --out")
    if run.exists() and not run.is_dir():
        raise UserError(f"--out {out} exists and is not a directory; choose another --out")
    _check_writable(run)
    has_run = holds_run(run)
    owner = live_owner(run)
    if owner is not None:
        raise UserError(f"--out {out} is in use by a live run ({owner}); wait for it to end or choose another "
                        f"--out")
    has_checkpoint = RunFiles(run).complete.exists() or \
        bool(resume_from and RunFiles(run).checkpoint(resume_from).is_dir())
    if resume and not has_checkpoint:
        if has_run:
            raise UserError(f"--resume: the run in {out} stopped before its first complete checkpoint, so there is "
                            f"nothing to resume; pass --overwrite instead of --resume to start it again")
        raise UserError(f"--resume: no complete checkpoint in {out}/checkpoints; start without --resume")
    if has_run and not (resume or overwrite):
        if not has_checkpoint:
            raise UserError(f"--out {out} holds a run that stopped before its first complete checkpoint; pass "
                            f"--overwrite to start it again, or choose another --out")
        raise UserError(f"--out {out} already holds a run; pass --resume to continue it, --overwrite to "
                        f"replace it, or choose another --out")
    if overwrite and run.is_dir():
        _check_deletable(out, run, has_run)
    return run


def holds_run(run: Path) -> bool:
    """A marker, or (runs written before the marker existed) a config.json of ours beside other run files."""
    if not run.is_dir():
        return False
    if (run / MARKER).is_file():
        return True
    return _is_our_config(RunFiles(run).config) or any((run / name).exists() for name in RUN_FILES[1:])


def _is_our_config(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"model", "data", "train"} <= set(data)


def _check_deletable(out: str, run: Path, has_run: bool) -> None:
    resolved, cwd = run.resolve(), Path.cwd().resolve()
    if resolved in (Path(resolved.anchor), Path.home().resolve(), cwd, *cwd.parents):
        raise UserError(f"--overwrite --out {out}: refusing to delete the root, home or current directory or one "
                        f"above it; choose a run directory such as runs/NAME")
    entries = sorted(p.name for p in run.iterdir())
    if not entries:
        return
    if not has_run:
        raise UserError(f"--overwrite --out {out}: the directory does not hold a moe_scale run (no {MARKER} or "
                        f"config.json of a run), and --overwrite deletes only runs; choose another --out")
    foreign = [name for name in entries if not _owned(name)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"--overwrite --out {out}: the directory also holds files moe_scale did not write "
                        f"({shown}); move them away or choose another --out")


def claim_run_dir(run: Path, resume: bool, overwrite: bool) -> RunLock:
    """On the writer rank, once every input has been checked and the engine is built: take the lock, then
    (with --overwrite) delete the previous run's files, and mark the directory as a run."""
    run.mkdir(parents=True, exist_ok=True)
    lock = RunLock.acquire(run)
    if overwrite and not resume:
        for path in sorted(run.iterdir()):
            if not _owned(path.name) or path.name == LOCK_NAME:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    write_json_atomic(run / MARKER, {"format": 1, "written_by": "moe_scale"})
    return lock


def _check_writable(run: Path) -> None:
    probe = run
    while not probe.exists():
        probe = probe.parent
    problem = f"--out {run}: cannot create files in {probe}; choose a writable --out"
    if not probe.is_dir():
        raise UserError(f"--out {run}: {probe} is a file, not a directory, so nothing can be created under it; "
                        f"choose another --out")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError:
        raise UserError(problem)
