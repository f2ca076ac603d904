"""--stream: training batches read lazily from any number of shards, one pass, with a resumable position.

Each rank runs `--stream-workers` readers (global reader id = rank x readers + i) over disjoint pieces of the
shards (data/shards.py). A reader shuffles its sentences with a buffer (fill it, then emit a uniformly drawn
element and put the next sentence in its place; seeded by (seed, reader id)), encodes them as
`<S> w1 .. wn </S>` and cuts its token stream into windows of T+1 tokens (consecutive windows share one
token, as in LMWindows). Row j of this rank's batch takes the next window of reader j mod readers.

Memory: the shuffle buffers and one window of carried tokens per reader; nothing else of the text.

Position: `state_dict()` is every reader's (piece, byte offset), shuffle buffer, RNG state and carried
tokens, taken before the look-ahead batch was read; restoring it and continuing yields exactly the batches
an uninterrupted run would have seen. The batch sequence depends on the number of ranks and readers (not
only on the global batch, unlike the in-memory path), so a resume must use the same layout (checked).

One pass: when any reader of any rank cannot fill the next batch, every rank learns it through an all-reduce
at the previous step (`last_step`), so all ranks stop together after the same step.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from moe_scale.data.shards import LineReader, plan_pieces
from moe_scale.data.vocab import Vocab
from moe_scale.errors import UserError


class ShuffledReader:
    """One reader: sentences from its pieces through a shuffle buffer, as token windows of T+1."""

    def __init__(self, reader: LineReader, vocab: Vocab, window: int, buffer_size: int, seed: int):
        self.reader, self.vocab, self.window, self.buffer_size = reader, vocab, window, max(buffer_size, 1)
        self.rng = np.random.default_rng(seed)
        self.buffer: list[str] = []
        self.carry: list[int] = []      # tokens read but not yet emitted as a window
        self.tokens_read = self.words_read = 0   # </S> counted in both; for the perplexity per word
        self.source_done = False
        self._lines: Iterator[str] | None = None

    def _next_line(self) -> str | None:
        if self.source_done:
            return None
        if self._lines is None:
            self._lines = iter(self.reader)
        line = next(self._lines, None)
        if line is None:
            self.source_done = True
        return line

    def _next_sentence(self) -> str | None:
        while len(self.buffer) < self.buffer_size and (line := self._next_line()) is not None:
            self.buffer.append(line)
        if not self.buffer:
            return None
        i = int(self.rng.integers(len(self.buffer)))
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        return self.buffer.pop()

    def next_window(self) -> list[int] | None:
        """T+1 tokens, or None when the data has run out."""
        while len(self.carry) < self.window:
            sentence = self._next_sentence()
            if sentence is None:
                return None
            ids = self.vocab.encode(sentence)
            self.carry += [Vocab.BOS_ID, *ids, Vocab.EOS_ID]
            self.tokens_read += len(ids) + 1
            self.words_read += len(sentence.split()) + 1
        out = self.carry[: self.window]
        self.carry = self.carry[self.window - 1:]   # the last token starts the next window
        return out

    def state_dict(self) -> dict:
        return {"reader": self.reader.state_dict(), "buffer": list(self.buffer), "carry": list(self.carry),
                "rng": copy.deepcopy(self.rng.bit_generator.state), "source_done": self.source_done}

    def load_state_dict(self, state: dict) -> None:
        self.reader.load_state_dict(state["reader"])
        self.buffer, self.carry = list(state["buffer"]), list(state["carry"])
        self.rng.bit_generator.state = state["rng"]
        self.source_done, self._lines = state["source_done"], None


class StreamBatches:
    """This rank's (inputs_BT, targets_BT) for consecutive steps, read from the shards once. A TrainingSource
    (data/source.py) of one pass, no epochs and a position of its own; its rows are each reader's windows."""

    row_layout = None
    steps_per_epoch = None

    def __init__(self, files: list[Path], vocab: Vocab, seq_len: int, global_rows: int, rank: int, world_size: int,
                 readers_per_rank: int, shuffle_buffer: int, seed: int,
                 min_over_ranks: Callable[[int], int] = lambda n: n):
        if global_rows % world_size:
            raise UserError(f"batch size {global_rows} is not divisible by the world size {world_size}; "
                            f"use a --batch-size that is a multiple of {world_size}")
        self.rows_per_rank, self.seq_len, self.min_over_ranks = global_rows // world_size, seq_len, min_over_ranks
        if self.rows_per_rank < readers_per_rank:
            raise UserError(f"--stream-workers {readers_per_rank} is more than the {self.rows_per_rank} rows each "
                            f"rank reads per step; use at most {self.rows_per_rank}")
        pieces = plan_pieces(files, world_size * readers_per_rank)
        first = rank * readers_per_rank
        self.readers = [ShuffledReader(LineReader(pieces[first + i]), vocab, seq_len + 1, shuffle_buffer,
                                       seed=seed * 1_000_003 + first + i) for i in range(readers_per_rank)]
        self.layout = {"world_size": world_size, "readers_per_rank": readers_per_rank, "seq_len": seq_len,
                       "global_rows": global_rows, "shuffle_buffer": shuffle_buffer, "seed": seed,
                       "files": [str(f) for f in files]}
        self.step = 0
        self._state_before_next = self._reader_states()
        self._next = self._read_batch()
        self.last_step: int | None = None   # set when the data runs out: the last step that has a batch
        self._check_next()

    def describe(self) -> str:
        return f"streaming {len(self.readers)} reader(s) per rank, one pass"

    @property
    def tokens_per_word(self) -> float:
        """Of the text read so far (see LMWindows.tokens_per_word)."""
        words = sum(r.words_read for r in self.readers)
        return sum(r.tokens_read for r in self.readers) / words if words else 1.0

    def _reader_states(self) -> list[dict]:
        return [r.state_dict() for r in self.readers]

    def _read_batch(self):
        rows = []
        for j in range(self.rows_per_rank):
            window = self.readers[j % len(self.readers)].next_window()
            if window is None:
                return None
            rows.append(window)
        win_BT1 = torch.tensor(rows, dtype=torch.int64)
        return win_BT1[:, :-1], win_BT1[:, 1:]

    def _check_next(self) -> None:
        """All ranks agree whether step `self.step` has a batch (one tiny all-reduce per step)."""
        if not self.min_over_ranks(int(self._next is not None)):
            self.last_step = self.step - 1
            if self.step == 0:
                raise UserError(f"the training data is too small for one batch of {self.rows_per_rank} rows x "
                                f"{self.seq_len + 1} tokens per rank; use a smaller --batch-size or --seq-len, "
                                "fewer --stream-workers, or more data")

    def batch(self, step: int, shuffle_seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of `step` (steps must come in order; `shuffle_seed` is unused: the buffer shuffles)."""
        if step != self.step:
            raise RuntimeError(f"streamed batches come in order: asked for step {step}, next is {self.step}")
        if self.last_step is not None and step > self.last_step:
            raise RuntimeError(f"the streamed data ended after step {self.last_step}")
        out = self._next
        self.step += 1
        self._state_before_next = self._reader_states()
        self._next = self._read_batch()
        self._check_next()
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "layout": self.layout, "readers": self._state_before_next}

    def load_state_dict(self, state: dict) -> None:
        if state["layout"] != self.layout:
            changed = sorted(k for k in self.layout if state["layout"].get(k) != self.layout[k])
            raise UserError(f"the checkpoint's data stream was written with another {', '.join(changed)}; "
                            "resume a streamed run with the same processes, --stream-workers, --seq-len, "
                            "--batch-size, --shuffle-buffer, --seed and data")
        for reader, reader_state in zip(self.readers, state["readers"]):
            reader.load_state_dict(reader_state)
        self.step = state["step"]
        self._state_before_next = self._reader_states()
        self._next = self._read_batch()
        self.last_step = None
        self._check_next()
