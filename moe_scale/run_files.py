"""The entries of a run directory, each named once: `RunFiles(run).config` and so on (what each holds and who
writes it: train/run_dir.py)."""

from __future__ import annotations

from pathlib import Path


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

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __truediv__(self, name: str) -> Path:
        return self.root / name

    @property
    def config(self) -> Path:
        return self.root / self.CONFIG

    @property
    def ds_config(self) -> Path:
        return self.root / self.DS_CONFIG

    @property
    def data_files(self) -> Path:
        return self.root / self.DATA_FILES

    @property
    def vocab(self) -> Path:
        return self.root / self.VOCAB

    @property
    def tokenizer(self) -> Path:
        return self.root / self.TOKENIZER

    @property
    def train_log(self) -> Path:
        return self.root / self.TRAIN_LOG

    @property
    def summary(self) -> Path:
        return self.root / self.SUMMARY

    @property
    def tb(self) -> Path:
        return self.root / self.TB

    @property
    def checkpoints(self) -> Path:
        return self.root / self.CHECKPOINTS

    @property
    def complete(self) -> Path:
        return self.checkpoints / self.COMPLETE

    def checkpoint(self, tag: str) -> Path:
        return self.checkpoints / tag

    @property
    def pruning(self) -> Path:
        return self.root / self.PRUNING

    @property
    def expert_load(self) -> Path:
        return self.root / self.EXPERT_LOAD

    @property
    def plots(self) -> Path:
        return self.root / self.PLOTS
