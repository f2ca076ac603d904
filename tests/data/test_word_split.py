"""moe_scale/data/word_split.py: Arrow's tokens are str.split()'s and the vocabulary's ids exactly, and text where
the two splits differ is declined (the rows are then encoded in Python, with the same result)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from datasets import Dataset

from moe_scale.data.batches import LMWindows
from moe_scale.data.vocab import Vocab
from moe_scale.data.word_split import encode_single_spaced
from tests.wikitext import wikitext_sentences


def _reference(texts: list[str], vocab: Vocab) -> np.ndarray:
    return np.array([t for s in texts for t in [Vocab.BOS_ID, *vocab.encode(s), Vocab.EOS_ID]], dtype=np.int32)


def _encode(texts: list[str], vocab: Vocab, type=pa.string()):
    return encode_single_spaced(pa.chunked_array([pa.array(texts[:7], type), pa.array(texts[7:], type)]),
                                vocab.words, Vocab.BOS_ID, Vocab.EOS_ID, Vocab.UNK_ID)


@pytest.mark.parametrize("type", [pa.string(), pa.large_string()])
def test_the_ids_of_real_text_equal_the_vocabularys_own_encoding(type):
    """WikiText-2 sentences (in two Arrow chunks), a vocabulary cut short so many words are out of it, and the
    literal specials in the text."""
    texts = wikitext_sentences("valid")[:400] + ["<UNK> a </S> b <S>", "x"]
    vocab = Vocab.build(texts[:200], max_size=500)
    tokens, ends, lengths = _encode(texts, vocab, type)
    assert tokens.dtype == np.int32 and np.array_equal(tokens, _reference(texts, vocab))
    assert lengths.tolist() == [len(t.split()) for t in texts] and ends.tolist() == np.cumsum(lengths + 2).tolist()
    assert (tokens == Vocab.UNK_ID).sum() > 100


@pytest.mark.parametrize("odd", ["a  b", "a\tb", "a\u00a0b", "a\u2003b", " a", "a ", "", "a\x1fb", "a\u0085b"])
def test_text_where_the_splits_differ_is_declined(odd):
    vocab = Vocab.build(["a b"])
    assert _encode(["a b"] * 8 + [odd], vocab) is None
    assert _encode(["a b"] * 9, vocab) is not None


def test_windows_from_arrow_and_from_python_are_the_same():
    """LMWindows' rows (several ranks' shares) from single-spaced text and from the same text with one tab, which
    goes the Python way: the same tokens and the same tokens per word."""
    texts = wikitext_sentences("valid")[:600]
    vocab = Vocab.build(texts, max_size=800)
    odd = [*texts[:-1], texts[-1].replace(" ", "\t", 1)]
    for world_size, rank in ((1, 0), (4, 1), (4, 3)):
        fast = LMWindows(Dataset.from_dict({"text": texts}), vocab, 8, 8, rank=rank, world_size=world_size)
        slow = LMWindows(Dataset.from_dict({"text": odd}), vocab, 8, 8, rank=rank, world_size=world_size)
        assert len(fast.rows) == len(slow.rows) == 8 // world_size
        assert all(np.array_equal(a, b) for a, b in zip(fast.rows, slow.rows))
        assert fast.tokens_per_word == slow.tokens_per_word and fast.num_windows == slow.num_windows
