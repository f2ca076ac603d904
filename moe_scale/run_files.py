"""The entries of a run directory, each named once: `RunFiles(run).config` and so on (what each holds and who
writes it: train/run_dir.py)."""

from __future__ import annotations

from pathlib import Path


def _entry(name: str, parent: str | None = None) -> property:
    """The path of entry `name` of the run directory (inside its entry `parent`, if given)."""
    return property(lambda self: self.root / name if parent is None else self.root / parent / name)


class RunFiles:
    MARKER = "moe_scale_run.json"
    LOCK = "lock"
    CONFIG = "config.json"
    DS_CONFIG = "ds_config.json"
    DATA_FILES = "data_files.json"
    VOCAB = "vocab"
    VOCAB_COUNTS = "vocab.counts"
    TOKENIZER = "tokenizer.json"
    TRAIN_LOG = "train_log.jsonl"
    SUMMARY = "summary.json"
    TB = "tb"
    CHECKPOINTS = "checkpoints"
    COMPLETE = "complete"   # in checkpoints/: names the newest complete checkpoint
    PRUNING = "pruning"
    EXPERT_LOAD = "expert_load.jsonl"
    PLOTS = "plots"
    ALL = (MARKER, LOCK, CONFIG, DS_CONFIG, DATA_FILES, VOCAB, VOCAB_COUNTS, TOKENIZER, TRAIN_LOG, SUMMARY, TB,
           CHECKPOINTS, PRUNING, EXPERT_LOAD, PLOTS)

    config, ds_config, data_files = _entry(CONFIG), _entry(DS_CONFIG), _entry(DATA_FILES)
    vocab, tokenizer, train_log, summary = _entry(VOCAB), _entry(TOKENIZER), _entry(TRAIN_LOG), _entry(SUMMARY)
    tb, checkpoints, complete = _entry(TB), _entry(CHECKPOINTS), _entry(COMPLETE, CHECKPOINTS)
    pruning, expert_load, plots = _entry(PRUNING), _entry(EXPERT_LOAD), _entry(PLOTS)

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def checkpoint(self, tag: str) -> Path:
        return self.checkpoints / tag
