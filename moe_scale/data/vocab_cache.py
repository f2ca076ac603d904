"""Vocabulary of streamed training shards: counted in one pass without holding the text, cached.

The cache key is the shard list with sizes and modification times plus --vocab-size and --min-count, so a
second run over the same shards (or every other rank) loads it instead of reading 100B words again. The
1B-word benchmark's own vocabulary (793,471 entries: every training word seen at least 3 times, plus
<S>, </S>, <UNK>) is `--min-count 3` with a --vocab-size of at least that.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path

from moe_scale.data.embedded import cache_root
from moe_scale.data.shards import LineReader, plan_pieces
from moe_scale.data.vocab import Vocab


def vocab_cache_path(files: list[Path], vocab_size: int, min_count: int) -> Path:
    key = json.dumps({"files": [[str(Path(f).resolve()), os.path.getsize(f), os.path.getmtime(f)] for f in files],
                      "vocab_size": vocab_size, "min_count": min_count})
    return cache_root() / "vocab" / hashlib.sha256(key.encode()).hexdigest()[:20] / "vocab"


def count_words(files: list[Path]) -> tuple[Counter, int]:
    counts: Counter = Counter()
    sentences = 0
    for line in LineReader(plan_pieces(files, 1)[0]):
        counts.update(line.split())
        sentences += 1
    return counts, sentences


def cached_stream_vocab(files: list[Path], vocab_size: int, min_count: int) -> Vocab:
    """Loads the cached vocabulary of these shards, or counts and caches it (atomic writes)."""
    path = vocab_cache_path(files, vocab_size, min_count)
    if path.is_file():
        return Vocab.load(path)
    counts, sentences = count_words(files)
    vocab = Vocab.from_counts(counts, sentences, vocab_size, min_count)
    vocab.save(path)
    return vocab
