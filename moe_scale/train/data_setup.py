"""From --data to token windows: split files, build or reload the vocabulary, shard rows by rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_scale.config import DataConfig
from moe_scale.data import (LMWindows, Vocab, load_sentences, load_splits, resolve_text_files, sentence_texts,
                            split_files)
from moe_scale.data.eval_windows import EvalWindows
from moe_scale.distributed.comm import collective_device
from moe_scale.distributed.launch import DistEnv
from moe_scale.errors import UserError


@dataclass
class LMData:
    vocab: Vocab
    train: LMWindows
    valid: EvalWindows
    valid_sentences: object
    train_sentences: object


def min_over_ranks(value: int) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def load_run_splits(config: DataConfig):
    """(train, valid, test) sentences for --data, with --valid-data / --test-data taking precedence."""
    if config.valid_data and config.test_data:   # nothing to hold out
        splits = {"train": load_sentences(split_files(config.data)["train"])}
    else:
        splits = load_splits(config.data, config.holdout_fraction)
    for split, spec in (("valid", config.valid_data), ("test", config.test_data)):
        if spec:
            splits[split] = load_sentences(resolve_text_files(spec, f"--{split}-data"))
    return splits["train"], splits["valid"], splits["test"]


def build_lm_data(config: DataConfig, env: DistEnv, global_rows: int, saved_vocab: Path | None) -> LMData:
    """Loads text and makes this rank's windows. The vocabulary is rebuilt deterministically on every rank
    (no file exchange needed), or reloaded from a resumed run."""
    train, valid, _ = load_run_splits(config)
    if saved_vocab is not None:
        if not saved_vocab.exists():
            raise UserError(f"{saved_vocab} is missing; the run directory is incomplete, start a new run")
        vocab = Vocab.load(saved_vocab)
    else:
        vocab = Vocab.build(sentence_texts(train), max_size=config.vocab_size, min_count=config.min_count)
    windows = dict(seq_len=config.seq_len, global_rows=global_rows, rank=env.rank, world_size=env.world_size,
                   min_over_ranks=min_over_ranks)
    return LMData(vocab, LMWindows(train, vocab, what="the training data", **windows),
                  EvalWindows(sentence_texts(valid), vocab, config.seq_len, global_rows, env.rank, env.world_size,
                              what="the validation data"), valid, train)
