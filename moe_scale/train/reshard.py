"""Layout-free training state, so a run resumes with another number of processes or another --ep-size.

DeepSpeed's optimizer files belong to the layout that wrote them (each rank's ZeRO partition of flat buffers, or its
expert-parallel rank's experts). Every checkpoint therefore also holds the same state by parameter name, in
`portable/`: `dense.pt` (every dense parameter's fp32 value and optimizer state, the schedule and the step) and
`experts_ep<r>.pt` (expert-parallel rank r's experts, stacked [L, ...], with their optimizer state) and
`vocab_rows<r>.pt` (rank r's rows of the vocabulary tables split over the ranks, with their optimizer state). A
resume with another layout builds the engine for the new layout and then gives each rank its slice: dense state
whole, expert state by global expert index, a vocabulary table's state by row (from the rows of any layout, or from
the whole table of a checkpoint that kept it whole). fp32 masters, Adam's moments and step are copied exactly, so
the continued run equals one that had used the new layout from the start with the same state.

Under ZeRO 1/2 and bf16 a parameter's fp32 master and moments are fragments of flat per-rank partitions: they are
read through each parameter's fragment (moe_scale/deepspeed_internals.py) and summed over its data-parallel
group (each entry lives on one rank), and written back the same way; DeepSpeed's own `safe_get_full_optimizer_state`
is not used because it misses the expert group's moments (it links them before the expert group has stepped).
Without ZeRO the optimizer's per-parameter state is copied as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param

from moe_scale.deepspeed_internals import (PARAM, any_flat_state, base_optimizer, full_optimizer_state,
                                           set_optimizer_state, set_step_counters, step_counters)
from moe_scale.errors import UserError
from moe_scale.models.vocab_parallel import split_parameter_groups, vocabulary_shards
from moe_scale.moe.deepspeed_adapter import ExpertParallelModule
from moe_scale.train.factored_optimizer import SAME_ON_EVERY_SHARD

PORTABLE = "portable"
VOCAB_PREFIX = "vocab_rows"   # vocab_rows<r>.pt: rank r's rows of the vocabulary tables
VOCAB_FILES = VOCAB_PREFIX + "*.pt"


@dataclass(frozen=True)
class _Split:
    """Where a parameter split over ranks lies in the whole: entries [first, first + count) of `total` along dim 0
    (experts, or rows of a vocabulary table), kept in the portable file `file` (written by the first rank of the
    parameter's expert-data-parallel group `group_name`). An expert weight under --etp-size is hidden shard
    `shard` of `shards` of those experts (`hidden`: how its shards split and join); a parameter without hidden
    units beside them (`hidden` None: the hierarchical gate's secondary matrices) is a whole copy on each shard."""

    first: int
    count: int
    total: int
    file: str
    group_name: str
    shard: int = 0
    shards: int = 1
    hidden: "_HiddenUnits | None" = None


@dataclass(frozen=True)
class _HiddenUnits:
    """How a stacked expert weight [L, ., D] splits into hidden shards along dim 1 and joins back: the first layer's
    rows by its kind (a gated kind's gate and up rows apart), the second layer's in order."""

    kind: object        # moe/experts/kinds.py's ExpertKind
    first_layer: bool

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        return self.kind.join_hidden(shards) if self.first_layer else torch.cat(shards, dim=1)

    def slice(self, whole: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
        if self.first_layer:
            return self.kind.hidden_slice(whole.transpose(0, 1), shard, shards).transpose(0, 1).contiguous()
        per = whole.shape[1] // shards
        return whole[:, shard * per:(shard + 1) * per].contiguous()


def split_parameters(model: torch.nn.Module) -> dict[str, _Split]:
    """Each parameter split over the expert-parallel ranks, by name: experts and row-split vocabulary tables."""
    found = {}
    for prefix, module in model.named_modules():
        if isinstance(module, ExpertParallelModule):
            for name, shard in module.expert_shards().items():
                hidden = _HiddenUnits(module.experts.kind, name.endswith("w_in")) \
                    if name in ("experts.w_in", "experts.w_out") else None
                found[f"{prefix}.{name}" if prefix else name] = _Split(
                    module.expert_rank * shard.per_rank, shard.per_rank, shard.total,
                    _experts_file(module.expert_rank, module.hidden_shard, module.tensor_parallel),
                    module.expert_group_name, module.hidden_shard, module.tensor_parallel, hidden)
    for name, shard in vocabulary_shards(model).items():
        found[name] = _Split(shard.first, shard.param.shape[0], shard.total, f"{VOCAB_PREFIX}{shard.rank}.pt",
                             shard.param.group_name)
    return found


def _experts_file(expert_rank: int, shard: int, shards: int) -> str:
    """experts_ep<r>.pt; with --etp-size T, experts_ep<r>_etp<s>of<T>.pt: shard s of rank r's experts."""
    return f"experts_ep{expert_rank}.pt" if shards == 1 else f"experts_ep{expert_rank}_etp{shard}of{shards}.pt"


def save_portable(engine, directory: Path, rank: int) -> None:
    """Every rank calls this (the full tensors are collectives); rank 0 writes the dense state, the first rank of
    each expert-data-parallel group its experts."""
    model = engine.module
    splits = split_parameters(model)
    expert_groups = split_parameter_groups(model) if dist.is_initialized() else {}
    dense, files = {}, {}
    for name, param in model.named_parameters():
        state = full_optimizer_state(engine, param)
        if is_moe_param(param):
            split = splits[name]
            group = expert_groups.get(split.group_name)
            if group is None or dist.get_rank(group=group) == 0:
                files.setdefault(split.file, {})[name] = {"first": split.first, "total": split.total,
                                                          "state": state}
        else:
            dense[name] = state
    target = directory / PORTABLE
    target.mkdir(exist_ok=True)
    if rank == 0:
        flat = any_flat_state(engine)
        global_steps, global_samples = step_counters(engine)
        common = {"scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
                  "flat_step": flat.get("step"), "global_steps": global_steps, "global_samples": global_samples}
        torch.save({"dense": dense, "common": common}, target / "dense.pt")
    for file, entries in files.items():
        torch.save(entries, target / file)


def has_portable(checkpoint: Path) -> bool:
    return (checkpoint / PORTABLE / "dense.pt").is_file()


def load_portable(engine, checkpoint: Path, only: set[str] | None = None) -> None:
    """Give this rank its share of a checkpoint written with any layout (engine built for the new one); `only`:
    just these parameters (their values and optimizer state), not the schedule or the step counters."""
    model = engine.module
    source = checkpoint / PORTABLE
    saved = torch.load(source / "dense.pt", weights_only=False)
    experts = _ExpertFiles(source)
    rows = _ExpertFiles(source, VOCAB_FILES)
    splits = split_parameters(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if only is None or name in only:
                state = _saved_state(name, param, splits.get(name), saved["dense"], experts, rows, checkpoint)
                _set_state(engine, param, state, saved["common"]["flat_step"])
    if only is not None:
        return
    common = saved["common"]
    if engine.lr_scheduler is not None and common["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(_per_group(common["scheduler"], len(engine.lr_scheduler.base_lrs)))
        for group, lr in zip(base_optimizer(engine).param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
    set_step_counters(engine, common["global_steps"], common["global_samples"])


def _per_group(scheduler: dict, groups: int) -> dict:
    """A schedule's state for `groups` optimizer groups: another layout may group the parameters otherwise (the
    vocabulary tables split over all ranks are a group of their own beside --ep-size's experts). Every group has
    the same learning rate (--lr), so each list holds one value, repeated."""
    state = dict(scheduler)
    for key in ("base_lrs", "_last_lr"):
        values = state.get(key)
        if isinstance(values, list) and values and len(values) != groups:
            if len(set(values)) != 1:
                raise UserError(f"the checkpoint's schedule has {len(values)} different learning rates for "
                                f"{groups} parameter groups; resume with the layout it was written with")
            state[key] = values[:1] * groups
    return state


def _saved_state(name: str, param, split: _Split | None, dense: dict, experts: "_ExpertFiles", rows: "_ExpertFiles",
                 checkpoint: Path):
    """The saved state of the part of parameter `name` this rank holds, from wherever the checkpoint kept it (the
    vocabulary files are read only for vocabulary tables, the experts' only for experts)."""
    if split is not None and not split.file.startswith(VOCAB_PREFIX):
        return experts.shard_of(name, split)
    if name in dense:
        if split is None:
            return dense[name]
        return {k: _rows(v, split.first, split.count, split.total) for k, v in dense[name].items()}   # kept whole
    if rows.has(name):   # split by rows there, held split or whole here
        return rows.slice(name, *((split.first, split.count, split.total) if split else (0, param.shape[0],
                                                                                             param.shape[0])))
    raise UserError(f"{checkpoint}: no saved state for parameter {name}; resume with the settings the checkpoint "
                    f"was written with")


def _rows(value, first: int, count: int, total: int):
    return value[first:first + count] if torch.is_tensor(value) and value.dim() and value.shape[0] == total \
        else value


def load_vocabulary_rows(model: torch.nn.Module, checkpoint: Path, names: set[str]) -> None:
    """The values (not the optimizer state) of the row-split tables `names` into `model`, split or whole."""
    rows = _ExpertFiles(checkpoint / PORTABLE, VOCAB_FILES)
    splits = split_parameters(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in names:
                split = splits.get(name)
                first, count = (split.first, split.count) if split else (0, param.shape[0])
                value = rows.slice(name, first, count, split.total if split else param.shape[0])[PARAM]
                param.data.copy_(value.to(param.device, param.dtype))


def _set_state(engine, param, state: dict, flat_step) -> None:
    value = state[PARAM]
    if tuple(value.shape) != tuple(param.shape):
        raise UserError(f"saved {tuple(value.shape)} for a parameter of shape {tuple(param.shape)}; the checkpoint "
                        f"was written for another model")
    set_optimizer_state(engine, param, state, flat_step)


_SHARD_FILE = re.compile(r"_etp(\d+)of(\d+)\.pt$")


class _ExpertFiles:
    """The experts_ep<r>.pt files (or the vocab_rows<r>.pt ones) of one checkpoint, read as needed; an --etp-size
    run's experts_ep<r>_etp<s>of<T>.pt files are its shards, joined into whole experts when read."""

    def __init__(self, source: Path, pattern: str = "experts_ep*.pt", paths: list[Path] | None = None):
        self.paths = sorted(source.glob(pattern)) if paths is None else paths
        self._loaded: dict[Path, dict] = {}
        shard_paths: dict[int, list[Path]] = {}   # shard s -> its files (an --etp-size checkpoint)
        for path in self.paths if paths is None else ():   # (one shard's own files: read as they are)
            found = _SHARD_FILE.search(path.name)
            if found:
                shard_paths.setdefault(int(found.group(1)), []).append(path)
        self.shards = [_ExpertFiles(source, paths=shard_paths[s]) for s in sorted(shard_paths)]

    def shard_of(self, name: str, split: _Split) -> dict:
        """The state of shard split.shard (of split.shards) of experts [first, first + count) of expert weight
        `name`: the saved shards joined into whole experts (when the checkpoint has them), then cut as asked."""
        if not self.shards:
            whole = self.slice(name, split.first, split.count, split.total)
        elif split.hidden is None:   # without hidden units (the hierarchical gate's secondary matrices): a copy
            whole = self.shards[0].slice(name, split.first, split.count, split.total)   # beside each shard
        else:
            parts = [shard.slice(name, split.first, split.count, split.total) for shard in self.shards]
            whole = {k: split.hidden.join([p[k] for p in parts]) if _by_hidden_units(k, parts[0][k]) else parts[0][k]
                     for k in parts[0]}
        if split.shards == 1 or split.hidden is None:
            return whole
        return {k: split.hidden.slice(v, split.shard, split.shards) if _by_hidden_units(k, v) else v
                for k, v in whole.items()}

    def has(self, name: str) -> bool:
        return any(name in self._file(path) for path in self.paths)

    def _file(self, path: Path) -> dict:
        if path not in self._loaded:
            self._loaded[path] = torch.load(path, weights_only=False)
        return self._loaded[path]

    def slice(self, name: str, first: int, count: int, total: int) -> dict:
        """The state of global experts [first, first + count) of parameter `name`, stacked."""
        pieces = {}
        for path in self.paths:
            entry = self._file(path).get(name)
            if entry is None:
                continue
            if entry["total"] != total:
                raise UserError(f"{path} holds {entry['total']} experts for {name}, the model {total}; resume "
                                f"with the settings the checkpoint was written with")
            saved_count = next(iter(entry["state"].values())).shape[0]
            lo, hi = max(first, entry["first"]), min(first + count, entry["first"] + saved_count)
            if lo < hi:
                pieces[lo] = {k: v[lo - entry["first"]:hi - entry["first"]] if _stacked(v, saved_count) else v
                              for k, v in entry["state"].items()}
        covered = sum(next(iter(p.values())).shape[0] for p in pieces.values())
        if covered != count:
            raise UserError(f"{self.paths[0].parent}: experts {first}..{first + count - 1} of {name} are not all "
                            f"saved (files missing?); use another checkpoint")
        parts = [pieces[k] for k in sorted(pieces)]
        return {k: torch.cat([p[k] for p in parts]) if _stacked(parts[0][k], None) else parts[0][k]
                for k in parts[0]}


def _by_hidden_units(key: str, value) -> bool:
    """Whether an expert weight's state entry `key` splits with its hidden units (the weight, Adam's moments, the
    factored row averages), or is whole on every shard (the factored column averages; the step)."""
    return _stacked(value, None) and key not in SAME_ON_EVERY_SHARD


def _stacked(value, count: int | None) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and (count is None or value.shape[0] == count)
