"""Word vocabulary: ids 0, 1, 2 are <UNK>, <S>, </S>; the rest by descending frequency, ties alphabetical."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from moe_scale.errors import UserError
from moe_scale.files import write_text_atomic


@dataclass(frozen=True)
class WordCounts:
    """A text's word occurrences (words as str.split() cuts them, the vocabulary's tokens) and its sentences."""
    words: Counter
    sentences: int

    @classmethod
    def of(cls, sentences: Iterable[str]) -> "WordCounts":
        texts = sentences if isinstance(sentences, list) else list(sentences)
        return cls(Counter(itertools.chain.from_iterable(map(str.split, texts))), len(texts))


class Vocab:
    UNK, BOS, EOS = "<UNK>", "<S>", "</S>"
    SPECIALS = (UNK, BOS, EOS)
    UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

    def __init__(self, words: list[str], counts: list[int] | None = None):
        """`counts`: training occurrences per id (<UNK>: out-of-vocabulary words, </S>: sentences), if known."""
        if counts is not None and len(counts) != len(words):
            raise ValueError(f"{len(counts)} counts for {len(words)} words")
        self.counts = counts
        if tuple(words[:3]) != self.SPECIALS:
            raise ValueError(f"the first three vocabulary words must be {self.SPECIALS}, got {words[:3]}")
        self.words = list(words)
        self._ids = {w: i for i, w in enumerate(self.words)}
        if len(self._ids) != len(self.words):
            raise ValueError("vocabulary words must be unique")

    @classmethod
    def build(cls, sentences: Iterable[str], max_size: int | None = None, min_count: int = 1) -> "Vocab":
        """Words with count >= min_count, most frequent first (ties alphabetical); max_size counts the specials."""
        return cls.from_word_counts(WordCounts.of(sentences), max_size, min_count)

    @classmethod
    def from_word_counts(cls, text: WordCounts, max_size: int | None = None, min_count: int = 1) -> "Vocab":
        return cls.from_counts(text.words, text.sentences, max_size, min_count)

    @classmethod
    def from_counts(cls, counts: Counter, num_sentences: int, max_size: int | None = None,
                    min_count: int = 1) -> "Vocab":
        """The vocabulary of `Vocab.build` from word counts already made (e.g. by a streaming pass)."""
        if max_size is not None and max_size < 4:
            raise UserError(f"vocabulary size {max_size} is too small; use a vocabulary size of at least 4 "
                            "(3 special tokens + 1 word)")
        counts = Counter(counts)
        for special in cls.SPECIALS:
            counts.pop(special, None)
        ranked = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
        if max_size is not None:
            ranked = ranked[: max_size - 3]
        oov = sum(counts.values()) - sum(counts[w] for w in ranked)
        return cls(list(cls.SPECIALS) + ranked, [oov, 0, num_sentences] + [counts[w] for w in ranked])

    def __len__(self) -> int:
        return len(self.words)

    def id(self, word: str) -> int:
        return self._ids.get(word, self.UNK_ID)

    def encode(self, sentence: str) -> list[int]:
        """Words -> ids (OOV -> UNK id); no BOS/EOS added."""
        ids = self._ids
        return [ids.get(w, 0) for w in sentence.split()]

    def encode_many(self, sentences: list[str]) -> list[list[int]]:
        return [self.encode(s) for s in sentences]

    def encode_with_word_starts(self, sentence: str) -> tuple[list[int], list[int]]:
        """(ids, starts): one word per token (the subword tokenizers' interface, data/subwords.py)."""
        ids = self.encode(sentence)
        return ids, [1] * len(ids)

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids if i not in (self.BOS_ID, self.EOS_ID))

    def token_text(self, token_id: int) -> str:
        return self.words[token_id]

    def save(self, path: Path) -> None:
        """One word per line, UTF-8, written atomically; the counts (if known) first, beside it (for the
        unigram sampler and adaptive-softmax FLOPs), so a reader that sees the vocabulary sees its counts."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.counts is not None:
            write_text_atomic(counts_path(path), "".join(f"{c}\n" for c in self.counts))
        write_text_atomic(path, "".join(w + "\n" for w in self.words))

    @classmethod
    def load(cls, path: Path) -> "Vocab":
        path = Path(path)
        fix = "delete it to rebuild the vocabulary from the data, or point to a file written by moe-scale"
        try:
            words = path.read_text(encoding="utf-8").split("\n")
        except FileNotFoundError:
            raise UserError(f"vocabulary file {path} does not exist; check the path or omit it to build one") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"vocabulary file {path} cannot be read ({e}); {fix}") from None
        if words and words[-1] == "":
            words.pop()
        if tuple(words[:3]) != cls.SPECIALS:
            raise UserError(f"vocabulary file {path} does not start with {' '.join(cls.SPECIALS)}; {fix}")
        bad = [i + 1 for i, w in enumerate(words) if not w or any(c.isspace() for c in w)]
        if bad:
            raise UserError(f"vocabulary file {path} line {bad[0]} is empty or has whitespace; {fix}")
        if len(set(words)) != len(words):
            raise UserError(f"vocabulary file {path} has duplicate words; {fix}")
        counts = None
        if counts_path(path).is_file():
            try:
                counts = [int(c) for c in counts_path(path).read_text(encoding="utf-8").split()]
            except ValueError:
                raise UserError(f"{counts_path(path)} is not one integer per line; {fix}") from None
            if len(counts) != len(words):
                raise UserError(f"{counts_path(path)} has {len(counts)} counts for {len(words)} words; {fix}")
        return cls(words, counts)


def counts_path(vocab_path: Path) -> Path:
    return Path(vocab_path).with_name(Path(vocab_path).name + ".counts")


def unigram_perplexity(train: Iterable[str] | WordCounts | None, eval_sentences: Iterable[str], vocab) -> float:
    """Per-word perplexity of an add-one smoothed unigram model over `vocab`'s tokens (one </S> per sentence,
    OOV -> <UNK>): exp(total NLL / (words + sentences)). `train`: the training sentences, or (for the word
    vocabulary) their WordCounts already made; None: from the vocabulary's own training counts (the same numbers)."""
    if train is None:
        if vocab.counts is None:
            raise ValueError("unigram_perplexity without training sentences needs vocabulary counts")
        counts = [c + 1 for c in vocab.counts]
    elif isinstance(vocab, Vocab):   # a token per word: count each distinct word once, not each occurrence
        text = train if isinstance(train, WordCounts) else WordCounts.of(train)
        counts = [1] * len(vocab)
        for word, count in text.words.items():
            counts[vocab.id(word)] += count
        counts[Vocab.EOS_ID] += text.sentences
    else:
        counts = [1] * len(vocab)
        for s in train:
            for i in vocab.encode(s):
                counts[i] += 1
            counts[Vocab.EOS_ID] += 1
    log_total = math.log(sum(counts))
    cost = [log_total - math.log(c) for c in counts]   # each token's NLL, added in text order below
    nll, n = 0.0, 0
    for s in eval_sentences:
        for i in vocab.encode(s):
            nll += cost[i]
        nll += cost[Vocab.EOS_ID]
        n += len(s.split()) + 1
    return math.exp(nll / n)
