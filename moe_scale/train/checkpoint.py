"""Checkpoints: DeepSpeed's format (one file per global expert, optimizer shards per rank), a manifest, a marker.

A checkpoint is written under a temporary name and renamed once every rank has finished; its manifest lists
every file's size and CRC-32, and `checkpoints/complete` names the newest complete one, so a run killed mid-save
resumes from the previous complete checkpoint, and a file cut short or corrupted later is caught before it is
loaded (resume, eval, prune-heads), with the older checkpoints that can be used instead. Checkpoints written
before the manifest existed load unchecked. The training state (train/state.py) is saved and restored whole:
its step as DeepSpeed's client state, and the position of a data source that has one of its own (`--stream`),
one file per rank (`data_stream_rank<r>.pt` in the checkpoint's directory), so a resumed run reads on exactly
where it stopped; random streams, and the in-memory data position, are functions of the step.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from moe_scale.data.source import TrainingSource
from moe_scale.deepspeed_internals import MODEL_STATES_FILE
from moe_scale.distributed.comm import collective_device
from moe_scale.interrupts import Interrupted
from moe_scale.errors import UserError
from moe_scale.files import write_json_atomic
from moe_scale.models.vocab_parallel import names_of, vocabulary_shards
from moe_scale.run_files import RunFiles
from moe_scale.train.reshard import has_portable, load_portable, load_vocabulary_rows, save_portable
from moe_scale.train.sharded_experts import sharded_state
from moe_scale.train.state import TrainState

MANIFEST = "manifest.json"
LAYOUT = "layout.json"
# Settings that fix the weights' shapes and meaning: a checkpoint loads only into a model built with its values.
_SHAPE_SECTIONS = ("model", "moe", "attention", "softmax")
_LAYOUT_KEYS = ("etp_size",)   # in a shape section, but how the model is laid out: a resume may change it
_CHUNK = 1 << 22


def save_checkpoint(engine, run: Path, state: TrainState, rank: int, *, rows: str | None, keep: int) -> None:
    """The engine and `state` after its step: DeepSpeed's files go to checkpoints/.partial-<tag>; once every rank
    has written, rank 0 adds the layout (processes, --ep-size, how `rows` were cut: the source's row_layout), a
    manifest (each file's size and CRC-32), renames the directory to <tag> and points checkpoints/complete at it,
    then deletes all but the newest `keep` checkpoints (0: none). A write that fails (a full disk, a read-only
    directory) on any rank stops every rank with one line, the partial directory removed; a run killed before the
    rename leaves the previous complete checkpoint as it was."""
    directory = RunFiles(run).checkpoints
    tag = f"step{state.step:08d}"
    partial = directory / f".partial-{tag}"
    if rank == 0 and partial.exists():   # a save killed earlier
        shutil.rmtree(partial)
    dist.barrier()

    def write_rank_files() -> None:
        engine.save_checkpoint(str(directory), tag=partial.name, client_state=state.client_state(),
                               save_latest=False)
        save_portable(engine, partial, rank)   # the same state by name, for a resume with another layout
        if state.data_position is not None:
            _save_stream_state(partial / f"data_stream_rank{rank}.pt", state.data_position)

    def finish() -> None:   # rank 0, once every rank's files are there
        if RunFiles(run).config.is_file():   # what the weights were trained as, checked on every load
            shutil.copyfile(RunFiles(run).config, partial / RunFiles.CONFIG)
        layout = {"world_size": dist.get_world_size() if dist.is_initialized() else 1, **_model_layout(engine.module)}
        if rows is not None:
            layout["rows"] = rows
        write_json_atomic(partial / LAYOUT, layout)
        write_json_atomic(partial / MANIFEST, _manifest(partial))
        if (directory / tag).exists():
            shutil.rmtree(directory / tag)
        partial.replace(directory / tag)
        write_json_atomic(directory / RunFiles.COMPLETE,
                          {"tag": tag, "step": state.step, "manifest": f"{tag}/{MANIFEST}"})

    try:
        _stop_if_any_failed(_attempt(write_rank_files, run, tag), run, partial, tag, rank)
        _stop_if_any_failed(_attempt(finish, run, tag) if rank == 0 else None, run, partial, tag, rank)
    except (Interrupted, KeyboardInterrupt):   # a second Ctrl-C while writing: no half checkpoint stays
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if rank == 0:
        tags = sorted(p.name for p in directory.glob("step*") if p.is_dir())
        for old in tags[:-keep] if keep else []:
            shutil.rmtree(directory / old, ignore_errors=True)
    dist.barrier()


def _attempt(write, run: Path, tag: str) -> UserError | None:
    """Runs `write`; the one line for a write the file system refused, None when it worked. Any other error
    surfaces as it is."""
    try:
        write()
    except (OSError, RuntimeError) as e:
        if (failure := _write_failed(e, run, tag)) is None:
            raise
        return failure
    return None


def _stop_if_any_failed(failure: UserError | None, run: Path, partial: Path, tag: str, rank: int) -> None:
    """Every rank learns whether any rank's write failed (one all-reduce), so all stop together rather than
    leaving the others waiting in the next collective; rank 0 removes the partial checkpoint."""
    failed = failure is not None
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([int(failed)], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    raise failure or UserError(f"writing checkpoint {tag} to {RunFiles(run).checkpoints} failed on another process; "
                               f"{_after_failure(run)}")


# torch.save's zip writer reports a failed write as a RuntimeError with one of these (and the C library's reason
# after "strerror: " where it has one).
_TORCH_WRITER_ERRORS = ("inline_container.cc", "iostream error", "PytorchStreamWriter", "file write failed",
                        "cannot be opened", "Parent directory")
_NEARLY_FULL = 256 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _write_failed(e: Exception, run: Path, tag: str) -> UserError | None:
    """The one line for a checkpoint the file system would not take (a full disk or quota, a read-only or
    unwritable directory; from Python or from torch's writer), with advice that works; None for any other error."""
    where = RunFiles(run).checkpoints
    if isinstance(e, OSError):
        code, reason = e.errno, e.strerror or str(e)
    elif any(marker in str(err) for err in (e, e.__context__) for marker in _TORCH_WRITER_ERRORS):
        code = _torch_writer_errno(str(e)) or _probe_errno(where)
        if code is None and _nearly_full(where):
            code = errno.ENOSPC
        reason = os.strerror(code) if code is not None else \
            f"torch could not write the file: {' '.join(str(e).split())[:200]}"
    else:
        return None
    if code in _NO_SPACE:
        free = _free_bytes(where)
        reason += f": {free >> 20} MiB free" if free is not None and ": " not in reason else ""
        fix = "free space on that file system"
    elif code in _NOT_WRITABLE:
        fix = "make that directory writable"
    else:
        fix = "check that directory and its file system"
    previous = latest_complete_tag(run)
    return UserError(f"writing checkpoint {tag} to {where} failed ({reason}); "
                     + (f"the previous complete checkpoint {previous} is intact" if previous else
                        "no earlier checkpoint exists") + f"; {fix}, then {_after_failure(run)}")


def _after_failure(run: Path) -> str:
    """What a run stopped by a failed checkpoint does next: resume from its last complete checkpoint, or (none
    yet) start again, as check_run_dir will ask."""
    if latest_complete_tag(run):
        return "continue with --resume"
    return "start the run again with --overwrite (there is no checkpoint to resume from)"


def _torch_writer_errno(message: str) -> int | None:
    """The errno named by torch's 'open file failed with strerror: ...', where it names one."""
    found = re.search(r"strerror: ([^\n.]+)", message)
    if found is None:
        return None
    return next((code for code in (*_NO_SPACE, *_NOT_WRITABLE, errno.ENOENT)
                 if os.strerror(code) == found.group(1).strip()), None)


def _probe_errno(directory: Path) -> int | None:
    """Why a file cannot be created in `directory` (torch's writer does not always say: a directory DeepSpeed
    could not create is 'Parent directory ... does not exist'); None where one can."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as e:
        return e.errno


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _nearly_full(path: Path) -> bool:
    """torch reports a write cut short by a full disk only as 'unexpected pos': tell it by the free space."""
    free = _free_bytes(path)
    return free is not None and free < _NEARLY_FULL


def _manifest(directory: Path) -> dict:
    return {str(path.relative_to(directory)): {"bytes": path.stat().st_size, "crc32": _crc32(path)}
            for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MANIFEST}


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def latest_complete_tag(run: Path) -> str | None:
    """The tag the marker names, or None (no complete checkpoint, or an unreadable marker)."""
    try:
        return json.loads(RunFiles(run).complete.read_text())["tag"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def problem_with(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint directory by its manifest (None: every file is there, whole)."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except FileNotFoundError:   # written before manifests existed: nothing to check against
        return None
    except ValueError:
        return f"{checkpoint / MANIFEST} is not valid JSON"
    for name, expected in manifest.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, the manifest says {expected['bytes']} (cut short?)"
        if _crc32(path) != expected["crc32"]:
            return f"{path} does not match its checksum (corrupted)"
    return None


def usable_checkpoints(run: Path) -> list[str]:
    """Tags of the checkpoints whose files are all there and whole, newest first."""
    directory = RunFiles(run).checkpoints
    tags = sorted((p.name for p in directory.glob("step*") if p.is_dir()), reverse=True)
    return [tag for tag in tags if problem_with(directory / tag) is None]


def choose_checkpoint(run: Path, tag: str | None, flag: str, config=None, resume_world: int | None = None
                      ) -> tuple[str, int]:
    """(tag, step) of the checkpoint to load: `tag`, else the newest complete one; verified against its
    manifest, against `config` (the model it will be loaded into) and, for a resume with `resume_world`
    processes, against the layout that wrote it. Anything wrong is one line naming the file and the checkpoints
    that can be used instead."""
    directory = RunFiles(run).checkpoints
    if tag is None:
        marker = directory / RunFiles.COMPLETE
        try:
            tag = json.loads(marker.read_text())["tag"]
        except FileNotFoundError:
            raise UserError(f"{run}: no complete checkpoint (checkpoints/complete is missing){_instead(run, flag)}") \
                from None
        except (ValueError, KeyError, TypeError, OSError):
            raise UserError(f"{marker} is unreadable (not the JSON moe_scale writes){_instead(run, flag)}") from None
    if not isinstance(tag, str) or not (directory / tag).is_dir():
        raise UserError(f"{run}: no checkpoint {tag} in {directory}{_instead(run, flag)}")
    problem = problem_with(directory / tag)
    if problem:
        raise UserError(f"checkpoint {tag}: {problem}{_instead(run, flag, skip=tag)}")
    if config is not None:
        _check_same_model(run, tag, config)
    if resume_world is not None:
        split = resume_world > 1 and config.parallel.vocab_exchange == "rows"
        _check_layout(run, tag, resume_world, config.expert_ranks, split, config.data.stream,
                      config.etp_size)
    return tag, int(tag.removeprefix("step"))


def _check_same_model(run: Path, tag: str, config) -> None:
    from moe_scale.config import RunConfig

    saved = RunFiles(run).checkpoint(tag) / RunFiles.CONFIG
    if not saved.is_file():   # written before checkpoints kept their config
        return
    trained = RunConfig.load(saved)
    for key, leaf in RunConfig.leaves().items():
        if leaf.path[0] in _SHAPE_SECTIONS and key not in _LAYOUT_KEYS and trained.get(key) != config.get(key):
            raise UserError(f"checkpoint {tag} was trained with {leaf.flag} {trained.get(key)}, but "
                            f"{run / 'config.json'} says {config.get(key)}; put the run's config back (the "
                            f"checkpoint keeps a copy: {saved})")


def _check_layout(run: Path, tag: str, world_size: int, ep_size: int, vocab_split: bool, streamed: bool,
                  etp_size: int = 1) -> None:
    """A resume with another number of processes, --ep-size, --etp-size or --vocab-exchange needs the checkpoint's
    portable state (`ep_size`: the ranks one copy of the experts spans, ep x etp)."""
    checkpoint = RunFiles(run).checkpoint(tag)
    saved = saved_layout(checkpoint)
    if _same_layout(saved, world_size, ep_size, vocab_split, etp_size):
        return
    was = f"{saved['world_size']} process{'es' if saved['world_size'] > 1 else ''} with --ep-size {saved['ep_size']}"
    if bool(saved["vocab_rows"]) != vocab_split and saved["world_size"] > 1:
        was += f" and --vocab-exchange {'rows' if saved['vocab_rows'] else 'dense'}"
    if streamed:
        raise UserError(f"checkpoint {tag} was written by {was}: a --stream run resumes only with the same layout "
                        f"(each rank's position in the stream is its own)")
    if not has_portable(checkpoint):
        raise UserError(f"checkpoint {tag} was written by {was} before checkpoints carried a portable copy of "
                        f"the state; resume it with that layout")


def saved_layout(checkpoint: Path) -> dict | None:
    """{"world_size", "ep_size", "rows", "vocab_rows"} of the run that wrote a checkpoint (None: written before
    this was recorded; "rows": "lines" before rows were cut by tokens; "vocab_rows": the vocabulary tables it kept
    split by rows, in its portable files)."""
    try:
        saved = json.loads((checkpoint / LAYOUT).read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise UserError(f"{checkpoint / LAYOUT} is unreadable; restore it or use another checkpoint") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("world_size"), int):
        raise UserError(f"{checkpoint / LAYOUT} is not the JSON moe_scale writes; restore it or use another "
                        f"checkpoint")
    return {"world_size": saved["world_size"], "ep_size": saved.get("ep_size", 1),
            "rows": saved.get("rows", "lines"), "vocab_rows": saved.get("vocab_rows", []),
            "etp_size": saved.get("etp_size", 1)}


def _same_layout(saved: dict | None, world_size: int, ep_size: int, vocab_split: bool, etp_size: int = 1) -> bool:
    return saved is None or (saved["world_size"], saved["ep_size"], bool(saved["vocab_rows"]), saved["etp_size"]) \
        == (world_size, ep_size, vocab_split, etp_size)


def _model_layout(model) -> dict:
    """What of the layout the model says: --ep-size (x --etp-size: the ranks one copy of the experts spans), the
    vocabulary tables it holds split by rows, and --etp-size where it is more than 1."""
    etp = _etp_size(model)
    return {"ep_size": _ep_size(model), "vocab_rows": sorted(vocabulary_shards(model)),
            **({"etp_size": etp} if etp > 1 else {})}


def _ep_size(model) -> int:
    from moe_scale.moe.deepspeed_adapter import ExpertParallelModule

    return next((m.ep_size for m in model.modules() if isinstance(m, ExpertParallelModule)), 1)


def _etp_size(model) -> int:
    from moe_scale.moe.deepspeed_adapter import ExpertParallelModule

    return next((m.tensor_parallel for m in model.modules() if isinstance(m, ExpertParallelModule)), 1)


def load_weights(engine, run: Path, tag: str, module_only: bool = False, sharded_from=None) -> dict:
    """DeepSpeed's load of checkpoint `tag` (weights only where `module_only`), and the rows of the vocabulary
    tables the checkpoint kept split (whole or split here, as the model holds them); returns its client state. A
    checkpoint that does not fit the model (a file edited by hand) is one line, not a traceback. `sharded_from`:
    the RunConfig of an --etp-size run, whose experts' shards load whole (train/sharded_experts.py; weights only)."""
    saved = saved_layout(RunFiles(run).checkpoint(tag))
    vocab_rows = set(saved["vocab_rows"]) if saved else set()
    try:
        if sharded_from is not None:
            engine.module.load_state_dict(sharded_state(engine.module, RunFiles(run).checkpoint(tag), sharded_from),
                                          strict=not vocab_rows)
            client_state = {}
        else:
            _, client_state = engine.load_checkpoint(str(RunFiles(run).checkpoints), tag=tag,
                                                     load_module_only=module_only,
                                                     load_optimizer_states=not module_only,
                                                     load_lr_scheduler_states=not module_only,
                                                     load_module_strict=not vocab_rows)
        if vocab_rows:   # DeepSpeed's files lack them (train/reshard.py), so its load could not be strict
            _check_keys(engine.module, RunFiles(run).checkpoint(tag), vocab_rows)
            load_vocabulary_rows(engine.module, RunFiles(run).checkpoint(tag), vocab_rows)
    except (RuntimeError, KeyError, ValueError, OSError) as e:
        if _secondary_gates_replicated(RunFiles(run).checkpoint(tag)):
            raise UserError(f"checkpoint {tag} was written before the hierarchical gate's secondary matrices were "
                            f"stored with their experts (moe_scale before 2026-11-26): eval and generate read it "
                            f"with 1 process; training cannot resume from it, start a new run") from None
        what = " ".join(str(e).split())[:300] or type(e).__name__
        raise UserError(f"checkpoint {tag} does not fit this model ({what}); was {run / 'config.json'} or "
                        f"{run / 'vocab'} edited? restore them, or use another checkpoint") from None
    return client_state or {}


def _check_keys(model, checkpoint: Path, vocab_rows: set[str]) -> None:
    """What a strict load checks, for a checkpoint whose vocabulary rows are not in DeepSpeed's files: that its
    module state holds every other key of the model and none the model lacks."""
    saved = torch.load(checkpoint / MODEL_STATES_FILE, map_location="cpu", weights_only=False, mmap=True)["module"]
    wanted = {key for key in model.state_dict() if ".deepspeed_moe.experts." not in key} - vocab_rows
    found = {key for key in saved if ".deepspeed_moe.experts." not in key}
    wanted -= names_of(model, vocab_rows)   # (a tied output layer's name too)
    if wanted != found:
        raise RuntimeError(f"keys the model lacks: {sorted(found - wanted)[:3]}, keys missing: "
                           f"{sorted(wanted - found)[:3]}")


def _secondary_gates_replicated(checkpoint: Path) -> bool:
    """Whether a checkpoint holds the hierarchical gate's secondary matrices whole in its non-expert file, as
    before they were sharded with their experts (read only after a load has failed)."""
    try:
        module = torch.load(checkpoint / MODEL_STATES_FILE, map_location="cpu", weights_only=False,
                            mmap=True)["module"]
    except Exception:   # unreadable or not DeepSpeed's: the caller's message stands
        return False
    return any(key.endswith("_secondary") for key in module)


def _instead(run: Path, flag: str, skip: str | None = None) -> str:
    usable = [t for t in usable_checkpoints(run) if t != skip]
    which = "an older complete one" if skip else "the newest complete one"
    return f"; use {which} with {flag} {usable[0]}" if usable else "; no other complete checkpoint"


def load_checkpoint(engine, run: Path, tag: str, state: TrainState, source: TrainingSource) -> None:
    """Restore checkpoint `tag` (one checkpoint_to_resume verified) into the engine, `state` (the run's step 0,
    its schedule set) and the training data `source`."""
    directory = RunFiles(run).checkpoints
    saved = saved_layout(directory / tag)
    world = dist.get_world_size() if dist.is_initialized() else 1
    split = vocabulary_shards(engine.module)
    if _same_layout(saved, world, _ep_size(engine.module), bool(split), _etp_size(engine.module)):
        step = int(load_weights(engine, run, tag)["step"])
        if split:   # the tables' optimizer state: each rank's own, in the portable files
            load_portable(engine, directory / tag, only=set(split))
    else:   # another layout: weights by global expert from DeepSpeed's files, then the portable state
        if saved is not None and max(saved["etp_size"], _etp_size(engine.module)) > 1:
            # expert shards of another size: DeepSpeed's expert files do not fit; the buffers and non-expert weights
            # from its module file, every parameter then from the portable state (shards joined and cut there)
            module = torch.load(directory / tag / MODEL_STATES_FILE, map_location="cpu", weights_only=False)["module"]
            engine.module.load_state_dict(module, strict=False)
        else:
            load_weights(engine, run, tag, module_only=True)
        load_portable(engine, directory / tag)
        step = int(tag.removeprefix("step"))
    _warn_if_rows_changed(tag, saved["rows"] if saved else "lines", source.row_layout, step)
    # a source with a position of its own has one at step 0 too
    state.resume(step, _data_position(directory / tag, step) if state.data_position is not None else None)
    source.load_state_dict(state.data_position)


def _data_position(checkpoint: Path, step: int) -> dict:
    """This rank's position in the training data as the checkpoint after `step` saved it."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = checkpoint / f"data_stream_rank{rank}.pt"
    if not path.is_file():
        raise UserError(f"{path} is missing: checkpoint {checkpoint.name} was not written by a streamed run "
                        "with this many processes; resume without --stream, or with the original layout")
    position = torch.load(path, weights_only=False)
    if position["step"] != step:
        raise UserError(f"{path} is at step {position['step']} but the checkpoint at step {step}; "
                        "the checkpoint directory is inconsistent, start a new run")
    return position


def _warn_if_rows_changed(tag: str, saved: str, rows: str | None, step: int) -> None:
    """A checkpoint written before rows were cut by tokens (they were cut by lines) resumes exactly, but the text
    is read in another order from there on: said once, by rank 0."""
    if rows is None or saved == rows or (dist.is_initialized() and dist.get_rank() != 0):
        return
    print(f"moe-scale: warning: checkpoint {tag} was trained on rows cut by {saved}, this version cuts them by "
          f"{rows}: the model and optimizer resume exactly, but from step {step} on the run reads the text in "
          f"another order; start a new run for one order throughout", file=sys.stderr, flush=True)


def checkpoint_to_resume(run: Path, tag: str | None, config) -> str:
    """The tag --resume loads (`tag`, else the newest complete one) for a model built from `config` with this many
    processes, verified by rank 0 alone (one read of the files, not one per rank on a shared file system); every
    rank gets the same tag or raises the same error."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return choose_checkpoint(run, tag, "--resume-from", config, resume_world=world)[0]
    answer = [None]
    if dist.get_rank() == 0:
        try:
            answer = [("ok", choose_checkpoint(run, tag, "--resume-from", config, resume_world=world)[0])]
        except UserError as e:
            answer = [("error", str(e))]
    dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise UserError(value)
    return value


def _save_stream_state(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
