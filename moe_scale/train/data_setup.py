"""From --data to token windows: split files, build or reload the tokenizer (word vocabulary, BPE or a
tokenizer.json), shard rows by rank."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_scale.config import DataConfig
from moe_scale.data import (LMWindows, Vocab, load_sentences, load_splits, resolve_text_files, sentence_texts,
                            split_files)
from moe_scale.data.eval_windows import EvalWindows
from moe_scale.data.shards import LineReader, plan_pieces
from moe_scale.data.source import TrainingSource
from moe_scale.data.text import SPLIT_RULE
from moe_scale.data.stream import StreamBatches
from moe_scale.data.subwords import SubwordTokenizer, load_run_tokenizer
from moe_scale.data.vocab import WordCounts, unigram_perplexity
from moe_scale.data.vocab_cache import cached_stream_vocab
from moe_scale.distributed.comm import collective_device
from moe_scale.distributed.launch import DistEnv
from moe_scale.errors import UserError
from moe_scale.run_files import RunFiles


@dataclass
class LMData:
    vocab: Vocab | SubwordTokenizer
    train: TrainingSource            # LMWindows, or StreamBatches when streaming
    valid: EvalWindows
    valid_sentences: object
    train_sentences: object          # None when streaming
    train_words: WordCounts | None = None   # the training text's, where the word vocabulary was built from it

    def unigram_valid_ppl(self) -> float:
        """Add-one unigram perplexity on the validation text (from the vocabulary's counts when streaming)."""
        train = self.train_words or (sentence_texts(self.train_sentences) if self.train_sentences is not None
                                     else None)
        if train is None and self.vocab.counts is None:   # streamed text, subword tokenizer: no counts kept
            return None
        return unigram_perplexity(train, sentence_texts(self.valid_sentences), self.vocab)


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


def _saved_tokenizer(run: Path):
    if not any((run / name).exists() for name in (RunFiles.VOCAB, RunFiles.TOKENIZER)):
        raise UserError(f"{run / 'vocab'} is missing; the run directory is incomplete, start a new run")
    return load_run_tokenizer(run)


_SAMPLE = 2000   # training sentences a --tokenizer file is checked on


def user_tokenizer(config: DataConfig) -> SubwordTokenizer | None:
    """--tokenizer PATH, loaded; None for words and bpe (built from the training text)."""
    return None if config.tokenizer in ("words", "bpe") else SubwordTokenizer.from_user_file(Path(config.tokenizer))


def trained_bpe(sentences, config: DataConfig) -> SubwordTokenizer:
    """--tokenizer bpe: learned once, on rank 0, and sent to the others (every rank then holds the same one)."""
    text = [SubwordTokenizer.train_bpe(sentences(), config.vocab_size, config.min_count).to_json()] \
        if not dist.is_initialized() or dist.get_rank() == 0 else [None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(text, src=0)
    return SubwordTokenizer.from_json(text[0])


def build_lm_data(config: DataConfig, env: DistEnv, global_rows: int, saved_run: Path | None,
                  seed: int = 0) -> LMData:
    """Loads text and makes this rank's windows. The word vocabulary is rebuilt deterministically on every rank
    (no file exchange needed), a BPE learned on rank 0 and broadcast; a resumed run reloads its own (from
    `saved_run`). With `config.stream`, see `build_stream_data` (`seed` shuffles its buffers)."""
    if config.stream:
        return build_stream_data(config, seed, env, global_rows, saved_run)
    vocab = _saved_tokenizer(saved_run) if saved_run is not None else user_tokenizer(config)
    train, valid, _ = load_run_splits(config)
    if vocab is not None and saved_run is None:
        vocab.check_user_file(config.tokenizer, sentence_texts(train.select(range(min(len(train), _SAMPLE)))))
    train_words = None
    if vocab is None and config.tokenizer == "bpe":
        vocab = trained_bpe(lambda: sentence_texts(train), config)
    elif vocab is None:
        train_words = WordCounts.of(sentence_texts(train))
        vocab = Vocab.from_word_counts(train_words, max_size=config.vocab_size, min_count=config.min_count)
    windows = dict(seq_len=config.seq_len, global_rows=global_rows, rank=env.rank, world_size=env.world_size,
                   min_over_ranks=min_over_ranks)
    return LMData(vocab, LMWindows(train, vocab, what="the training data", **windows),
                  EvalWindows(sentence_texts(valid), vocab, config.seq_len, global_rows, env.rank, env.world_size,
                              what="the validation data"), valid, train, train_words)


def stream_files(config: DataConfig) -> tuple[list[Path], object]:
    """(training shard paths, validation sentences) without reading the training text."""
    files = split_files(config.data)
    if config.valid_data:
        valid = load_sentences(resolve_text_files(config.valid_data, "--valid-data"))
    elif files["valid"] or files["test"]:
        valid = load_sentences(files["valid"] or files["test"])
    else:
        raise UserError(f"--stream needs a validation split it does not have to cut from the training text: "
                        f"files the split rule names valid or test beside --data {config.data} ({SPLIT_RULE}), or "
                        f"--valid-data")
    return files["train"], valid


def build_stream_data(config: DataConfig, seed: int, env: DistEnv, global_rows: int,
                      saved_run: Path | None) -> LMData:
    """Streaming training batches; the word vocabulary counted in one pass and cached (rank 0 counts, the
    others load the cache after a barrier), a BPE learned in one pass on rank 0, or reloaded from a resumed run."""
    train_files, valid = stream_files(config)
    vocab = _saved_tokenizer(saved_run) if saved_run is not None else user_tokenizer(config)
    if vocab is not None and saved_run is None:
        vocab.check_user_file(config.tokenizer, list(itertools.islice(LineReader(plan_pieces(train_files, 1)[0]),
                                                                      _SAMPLE)))
    if vocab is None and config.tokenizer == "bpe":
        vocab = trained_bpe(lambda: (line for line in LineReader(plan_pieces(train_files, 1)[0])), config)
    elif vocab is None:
        if env.rank == 0:
            cached_stream_vocab(train_files, config.vocab_size, config.min_count)
        if dist.is_initialized():
            dist.barrier()
        vocab = cached_stream_vocab(train_files, config.vocab_size, config.min_count)
    train = StreamBatches(train_files, vocab, config.seq_len, global_rows, env.rank, env.world_size,
                          config.stream_workers, config.shuffle_buffer, seed,
                          min_over_ranks=min_over_ranks)
    return LMData(vocab, train, EvalWindows(sentence_texts(valid), vocab, config.seq_len, global_rows, env.rank,
                                            env.world_size, what="the validation data"), valid, None)

