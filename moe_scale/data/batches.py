"""Language-model windows laid out so that the global batch does not depend on the world size.

Legend (docs/shapes.md): B sequences (rows) on this rank, T positions (seq_len).

The global batch has `rows` rows (= the global batch size; B = rows / world_size on each rank), each cut into
`num_windows` windows. Row i holds the i-th of `rows` contiguous runs of sentences, each sentence as
<S> w1 .. wn </S>; the runs are cut where the running count of tokens reaches i/rows of the text's (not after
equal numbers of lines: paragraphs vary, and the shortest row ends an epoch), so rows differ by less than one
sentence. Window w of a row is tokens [w*T, w*T + T] (T+1 tokens; consecutive
windows share one token), split into inputs = window[:-1] and targets = window[1:].

A rank reads and tokenizes only its own B rows. Step s uses window (s mod num_windows) of every row (after an
optional per-epoch permutation that every rank draws identically), so the batches of ranks 0..n-1,
concatenated in rank order, are exactly the one-process batch — what makes an n-process run equal a
one-process run. num_windows is the minimum over all rows, found with the trainer's all-reduce MIN.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset

from moe_scale.data.text import sentence_texts
from moe_scale.data.vocab import Vocab
from moe_scale.data.word_split import OTHER_SPACE, encode_single_spaced
from moe_scale.errors import UserError


def _encode_row(texts: list[str], vocab: Vocab) -> np.ndarray:
    out: list[int] = []
    for ids in vocab.encode_many(texts):
        out.append(Vocab.BOS_ID)
        out.extend(ids)
        out.append(Vocab.EOS_ID)
    return np.asarray(out, dtype=np.int32)


def _encode_rows(sentences: Dataset, bounds: np.ndarray, vocab) -> tuple[list[np.ndarray], int]:
    """(rows, words): row i holds sentences [bounds[i], bounds[i+1]) as <S> w1 .. wn </S> int32 tokens; words counts
    every sentence's words and its </S>. The word vocabulary's single-spaced text is encoded by Arrow in one pass."""
    lo, hi = int(bounds[0]), int(bounds[-1])
    if isinstance(vocab, Vocab) and hi > lo:
        text = sentences.select(range(lo, hi)).with_format("arrow")[:].column("text")
        encoded = encode_single_spaced(text, vocab.words, Vocab.BOS_ID, Vocab.EOS_ID, Vocab.UNK_ID)
        if encoded is not None:
            tokens, ends, lengths = encoded
            ends = np.concatenate([[0], ends])
            rows = [tokens[ends[a - lo]: ends[b - lo]] for a, b in zip(bounds[:-1], bounds[1:])]
            return rows, int(lengths.sum()) + (hi - lo)
    rows, words = [], 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        texts = sentence_texts(sentences.select(range(int(start), int(end)))) if end > start else []
        rows.append(_encode_row(texts, vocab))
        words += sum(len(t.split()) + 1 for t in texts)   # each </S> counts as a word
    return rows, words


def _tokens_per_word(rows: list[np.ndarray], words: int) -> float:
    sentences = sum(int((r == Vocab.BOS_ID).sum()) for r in rows)
    tokens = sum(len(r) for r in rows) - sentences
    return tokens / words if words else 1.0


def row_bounds(sentences: Dataset, rows: int, batch_size: int = 1 << 16) -> np.ndarray:
    """R+1 sentence indices: row i is sentences [b[i], b[i+1]), the sentences whose middle token falls in the
    i-th R-th of the text, a sentence counting as its words + 2 tokens (<S> and </S>; the word vocabulary's count;
    `load_sentences` strips every line, so a sentence has one run of whitespace fewer than words). Arrow counts
    the runs in pieces of `batch_size` sentences: single spaces (most corpora) by a substring count, a piece with
    other whitespace by a regex (tokenizing would cost ~20x more, on every rank); every rank computes the same
    bounds."""
    n = len(sentences)
    if n == 0:
        return np.zeros(rows + 1, dtype=np.int64)
    gaps = []
    for piece in sentences.with_format("arrow").iter(batch_size=batch_size):
        text = piece.column("text")
        if pc.any(pc.match_substring_regex(text, f"  |{OTHER_SPACE}")).as_py():
            counts = pc.count_substring_regex(text, f"(?:{OTHER_SPACE}| )+")
        else:
            counts = pc.count_substring(text, " ")
        gaps.append(counts.to_numpy(zero_copy_only=False))
    tokens = np.concatenate(gaps).astype(np.int64) + 3
    middle_x2 = 2 * np.cumsum(tokens) - tokens   # twice the position of each sentence's middle
    starts = np.searchsorted(middle_x2 * rows, np.arange(rows, dtype=np.int64) * 2 * int(tokens.sum()), side="left")
    return np.append(starts, n)


class LMWindows:
    """Token windows for a causal LM: `batch(step)` gives this rank's (inputs_BT, targets_BT), int64. A
    TrainingSource (data/source.py): epochs repeat without end, and the position is a function of the step."""

    # How rows are cut, recorded in every checkpoint: a resume from one cut otherwise reads another text order.
    row_layout = "tokens"
    last_step = None

    def __init__(self, sentences: Dataset, vocab: Vocab, seq_len: int, global_rows: int,
                 rank: int = 0, world_size: int = 1, min_over_ranks: Callable[[int], int] = lambda n: n,
                 what: str = "the training data"):
        if seq_len < 1 or global_rows < 1:
            raise UserError(f"sequence length {seq_len} and batch size {global_rows} must be positive; "
                            "set --seq-len and --batch-size to at least 1")
        if global_rows % world_size != 0:
            raise UserError(f"batch size {global_rows} is not divisible by the world size {world_size}; "
                            f"use a --batch-size that is a multiple of {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.seq_len, self.global_rows, self.rank, self.world_size = seq_len, global_rows, rank, world_size
        self.rows_per_rank = global_rows // world_size
        first = rank * self.rows_per_rank
        bounds = row_bounds(sentences, global_rows)
        self.rows, words = _encode_rows(sentences, bounds[first: first + self.rows_per_rank + 1], vocab)
        # tokens per word of this rank's text (</S> both a token and a word; <S> neither): 1 for the word
        # vocabulary; the training perplexity per word is exp(loss per token x this)
        self.tokens_per_word = _tokens_per_word(self.rows, words)
        # All ranks take part in the reduction (and raise together) even if their rows are empty.
        shortest = int(min_over_ranks(min(len(r) for r in self.rows)))
        self.num_windows = (shortest - 1) // seq_len if shortest > 0 else 0  # W
        if self.num_windows < 1:
            raise UserError(
                f"{what} is too small for batch size {global_rows} x sequence length {seq_len}: each of the "
                f"{global_rows} rows needs at least {seq_len + 1} tokens (about {global_rows * (seq_len + 1)} "
                f"tokens in all) but the shortest row has {shortest}; use a smaller --batch-size or --seq-len, "
                "or more data")
        self._perm: tuple[tuple[int, int], np.ndarray] | None = None  # ((seed, epoch), permutation)

    @property
    def epoch_share(self) -> float:
        """The share of this rank's target tokens an epoch trains on: rows end at sentence boundaries, and a
        step takes the same window of every row, so the tail of every row past the shortest row's last whole
        window is unused (under one sentence plus one window per row)."""
        available = sum(max(len(r) - 1, 0) for r in self.rows)
        return self.rows_per_rank * self.num_windows * self.seq_len / available

    @property
    def steps_per_epoch(self) -> int:
        return self.num_windows

    def describe(self) -> str:
        whose = "the training tokens" if self.world_size == 1 else "the tokens in this rank's rows"
        return (f"{self.num_windows} steps per epoch ({self.epoch_share:.0%} of {whose}: the shortest of the "
                f"{self.global_rows} rows ends an epoch)")

    def window_index(self, step: int, shuffle_seed: int | None = None) -> int:
        """Which window of every row step `step` uses."""
        epoch, w = divmod(step, self.num_windows)
        if shuffle_seed is None:
            return w
        key = (shuffle_seed, epoch)
        if self._perm is None or self._perm[0] != key:
            self._perm = (key, np.random.default_rng(key).permutation(self.num_windows))
        return int(self._perm[1][w])

    def _window(self, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        win_BT1 = np.stack([r[w * T: w * T + T + 1] for r in self.rows]).astype(np.int64)
        win_BT1 = torch.from_numpy(win_BT1)
        return win_BT1[:, :-1], win_BT1[:, 1:]

    def batch(self, step: int, shuffle_seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_BT, targets_BT) for this rank's rows at `step` (epoch = step // num_windows)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self._window(self.window_index(step, shuffle_seed))

    def state_dict(self) -> None:
        """Nothing for a checkpoint: the step says which window comes next."""
        return None

    def load_state_dict(self, state: None) -> None:
        """Nothing to restore (see `state_dict`)."""

    def all_windows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every window in order (for evaluation): (inputs_BT, targets_BT) per window."""
        for w in range(self.num_windows):
            yield self._window(w)

    @property
    def num_tokens(self) -> int:
        """Target tokens per epoch on this rank (B * W * T)."""
        return self.rows_per_rank * self.num_windows * self.seq_len
