"""Vocabulary counts (saved beside the vocabulary) and the streamed, cached vocabulary."""

from __future__ import annotations

import pytest

from moe_scale.data import vocab_cache
from moe_scale.data.vocab import Vocab, counts_path, unigram_perplexity
from moe_scale.errors import UserError

TEXT = ["a b c a", "b a d", "zz a"]


def test_counts_follow_the_vocabulary_and_survive_save_and_load(tmp_path):
    vocab = Vocab.build(TEXT, max_size=6)
    assert vocab.words == ["<UNK>", "<S>", "</S>", "a", "b", "c"]
    assert vocab.counts == [2, 0, 3, 4, 2, 1]          # <UNK>: d and zz; </S>: one per sentence
    vocab.save(tmp_path / "vocab")
    loaded = Vocab.load(tmp_path / "vocab")
    assert loaded.words == vocab.words and loaded.counts == vocab.counts
    # the unigram baseline from counts equals the one from the sentences
    assert unigram_perplexity(None, ["a b", "c zz"], vocab) == pytest.approx(
        unigram_perplexity(TEXT, ["a b", "c zz"], vocab), rel=1e-12)
    counts_path(tmp_path / "vocab").write_text("1\n2\n")
    with pytest.raises(UserError, match="2 counts for 6 words"):
        Vocab.load(tmp_path / "vocab")


def test_streamed_vocabulary_is_counted_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path / "cache"))
    shards = [tmp_path / "s1", tmp_path / "s2"]
    shards[0].write_text("a b c a\nb a d\n")
    shards[1].write_text("zz a\n")
    first = vocab_cache.cached_stream_vocab(shards, 6, 1)
    assert first.words == Vocab.build(TEXT, max_size=6).words and first.counts == Vocab.build(TEXT, 6).counts
    calls = []
    monkeypatch.setattr(vocab_cache, "count_words", lambda files: calls.append(files))
    again = vocab_cache.cached_stream_vocab(shards, 6, 1)
    assert calls == [] and again.words == first.words          # loaded from the cache, nothing re-read
    assert vocab_cache.vocab_cache_path(shards, 6, 1) != vocab_cache.vocab_cache_path(shards, 6, 2)
    key = vocab_cache.vocab_cache_path(shards, 6, 1)
    shards[1].write_text("zz a b\n")                            # changed data: another key, counted afresh
    assert vocab_cache.vocab_cache_path(shards, 6, 1) != key
