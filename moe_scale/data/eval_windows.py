"""Evaluation windows for per-word perplexity "the standard way" (as on the 1B-word benchmark).

Legend (docs/shapes.md): B sequences (evaluation windows), T positions.

The text is one token stream `<S> w1 .. wn </S> <S> ...`. Every word (out-of-vocabulary words as <UNK>) and
every sentence's `</S>` is predicted exactly once; `<S>` is context only, never a target. The stream is cut
into windows of T inputs; window w holds stream[w*T : w*T+T] as inputs and stream[w*T+1 : w*T+T+1] as
targets, so no target is dropped: the last window is padded, and padded or `<S>` targets are IGNORE
(the softmax layers give them zero loss).

Whatever the tokenizer, perplexity is per word: exp(sum of NLL / (words + sentences)), each target token
weighted by the whitespace words that begin at it (`word_starts`; every token for the word vocabulary, the
first piece of each word for a subword tokenizer, 1 for each </S>), so subword and word runs count in one
unit (their numbers compare on the same text at an OOV rate near 0: docs/data.md#which-perplexities-compare).

Global batch b holds windows b*R .. b*R+R-1 (R rows); rank r takes rows r*B .. r*B+B-1 (B = R / ranks),
and every rank runs the same number of batches (all-to-all needs that); empty rows are all IGNORE. So the
sum of NLL does not depend on the number of processes. The model sees T tokens of context at most (each
window starts fresh, as in training).
"""

from __future__ import annotations

from array import array
from typing import Iterator

import numpy as np
import torch

from moe_scale.data.vocab import Vocab
from moe_scale.errors import UserError
from moe_scale.labels import IGNORE


class EvalWindows:
    def __init__(self, sentences: list[str], vocab: Vocab, seq_len: int, global_rows: int, rank: int = 0,
                 world_size: int = 1, what: str = "the evaluation data"):
        if global_rows % world_size:
            raise ValueError(f"{global_rows} rows do not split over {world_size} ranks")
        ids = array("q")   # not a list: 8 bytes per token instead of ~36 (lm1b's held-out shard: 160k words)
        starts = array("b")   # words beginning at each token (<S>: 0, </S>: 1)
        words = oov = 0
        for sentence in sentences:
            encoded, word_starts = vocab.encode_with_word_starts(sentence)
            ids.append(Vocab.BOS_ID)
            ids.extend(encoded)
            ids.append(Vocab.EOS_ID)
            starts.append(0)
            starts.extend(min(n, 127) for n in word_starts)
            starts.append(1)
            words += len(sentence.split())
            oov += sum(1 for i in encoded if i == Vocab.UNK_ID) - sentence.split().count(Vocab.UNK)
        if not sentences:
            raise UserError(f"{what} has no sentences; give a file with one sentence per line")
        self.tokens = np.frombuffer(ids, dtype=np.int64).copy()    # the whole stream (for contexts in expert reports)
        self.word_starts = torch.from_numpy(np.frombuffer(starts, dtype=np.int8).astype(np.int64))
        self.seq_len, self.global_rows, self.rank, self.world_size = seq_len, global_rows, rank, world_size
        self.rows_per_rank = global_rows // world_size
        self.num_windows = -(-(len(self.tokens) - 1) // seq_len)
        self.num_batches = -(-self.num_windows // global_rows)
        self.counts = {"words": words, "sentences": len(sentences), "oov_words": max(oov, 0),
                       "counted_tokens": len(self.tokens) - len(sentences)}

    def batch_positions(self, batch: int) -> torch.Tensor:
        """Stream positions [B, T] of this rank's input tokens in global batch `batch` (-1: padding)."""
        T = self.seq_len
        first_window = batch * self.global_rows + self.rank * self.rows_per_rank
        windows_B = torch.arange(first_window, first_window + self.rows_per_rank)
        pos_BT = windows_B[:, None] * T + torch.arange(T)[None, :]
        return torch.where(pos_BT < len(self.tokens) - 1, pos_BT, torch.full_like(pos_BT, -1))

    def real_tokens(self, batch: int) -> torch.Tensor:
        """[B, T] bool: True where this rank's input in global batch `batch` is text, False on padding."""
        return self.batch_positions(batch) >= 0

    def counted_words(self, batch: int) -> int:
        """Words (and </S>) whose targets this rank counts in global batch `batch`: the perplexity's denominator."""
        pos_BT = self.batch_positions(batch)
        return int(self.word_starts[(pos_BT + 1)[pos_BT >= 0]].sum())

    def all_windows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs_BT, targets_BT) per global batch, this rank's rows; targets IGNORE where not counted."""
        stream = torch.from_numpy(self.tokens)
        for b in range(self.num_batches):
            pos_BT = self.batch_positions(b)
            real_BT = pos_BT >= 0
            inputs_BT = torch.where(real_BT, stream[pos_BT.clamp(min=0)], torch.full_like(pos_BT, Vocab.EOS_ID))
            targets_BT = stream[(pos_BT + 1).clamp(min=0)]
            counted_BT = real_BT & (targets_BT != Vocab.BOS_ID)
            yield inputs_BT, torch.where(counted_BT, targets_BT, torch.full_like(targets_BT, IGNORE))
