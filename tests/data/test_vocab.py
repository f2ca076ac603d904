import math

import pytest

from moe_scale.data.vocab import Vocab, WordCounts, unigram_perplexity
from moe_scale.errors import UserError

SENTS = ["b a c a", "c a b", "d e", "a"]  # counts: a 4, b 2, c 2, d 1, e 1


def test_specials_first_and_frequency_order():
    v = Vocab.build(SENTS)
    assert v.words == ["<UNK>", "<S>", "</S>", "a", "b", "c", "d", "e"]
    assert (v.id("<UNK>"), v.id("<S>"), v.id("</S>")) == (0, 1, 2)
    assert len(v) == 8 and v.id("a") == 3 and v.id("zzz") == 0


def test_tie_order_is_alphabetical_not_first_seen():
    assert Vocab.build(["z y x", "x y z"]).words[3:] == ["x", "y", "z"]
    assert Vocab.build(["x y z"]).words == Vocab.build(["z y x"]).words


def test_cutoffs():
    assert Vocab.build(SENTS, max_size=5).words[3:] == ["a", "b"]
    assert Vocab.build(SENTS, min_count=2).words[3:] == ["a", "b", "c"]
    assert Vocab.build(SENTS, max_size=4, min_count=2).words[3:] == ["a"]
    with pytest.raises(UserError, match="at least 4"):
        Vocab.build(SENTS, max_size=3)


def test_specials_in_text_are_not_duplicated():
    v = Vocab.build(["<UNK> a </S>"])
    assert v.words == ["<UNK>", "<S>", "</S>", "a"]


def test_encode():
    v = Vocab.build(SENTS)
    assert v.encode("a  b zzz\te") == [3, 4, 0, 7]
    assert v.encode("") == []


def test_save_load_round_trip(tmp_path):
    v = Vocab.build(SENTS + ["ünïcode wörds"])
    path = tmp_path / "sub" / "vocab.txt"
    v.save(path)
    assert Vocab.load(path).words == v.words
    assert sorted(p.name for p in path.parent.iterdir()) == ["vocab.txt", "vocab.txt.counts"]  # no temp file left


@pytest.mark.parametrize("content, why", [
    ("a\n<UNK>\n<S>\n</S>\n", "does not start"),
    ("", "does not start"),
    ("<UNK>\n<S>\n</S>\na\na\n", "duplicate"),
    ("<UNK>\n<S>\n</S>\na b\n", "whitespace"),
    ("<UNK>\n<S>\n</S>\n\nb\n", "line 4"),
])
def test_corrupt_file(tmp_path, content, why):
    path = tmp_path / "vocab.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=why) as e:
        Vocab.load(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_missing_and_binary_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        Vocab.load(tmp_path / "nope.txt")
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserError, match="cannot be read"):
        Vocab.load(tmp_path / "bin")


def test_unigram_perplexity_by_hand():
    v = Vocab.build(["a a b"])  # words: <UNK> <S> </S> a b
    # add-one counts: UNK 1, S 1, /S 1+1, a 1+2, b 1+1 -> total 9
    ppl = unigram_perplexity(["a a b"], ["a zzz"], v)  # tokens a, UNK, </S>
    assert math.isclose(ppl, math.exp(-(math.log(3 / 9) + math.log(1 / 9) + math.log(2 / 9)) / 3))


def _unigram_reference(train: list[str], eval_sentences: list[str], vocab: Vocab) -> float:
    """The definition token by token: every training token counted, every evaluated token's NLL added in order."""
    counts = [1] * len(vocab)
    for s in train:
        for i in vocab.encode(s) + [Vocab.EOS_ID]:
            counts[i] += 1
    total = sum(counts)
    nll = sum(math.log(total) - math.log(counts[i]) for s in eval_sentences for i in vocab.encode(s) + [Vocab.EOS_ID])
    return math.exp(nll / sum(len(s.split()) + 1 for s in eval_sentences))


def test_unigram_perplexity_from_word_counts_is_the_token_by_token_definition_exactly():
    """Each distinct word counted once (WordCounts) gives the per-token loop's number to the last bit: OOV words,
    literal specials in the text (counted by their ids, though the vocabulary leaves them out of its counts), a
    vocabulary cut short, tabs and repeated spaces."""
    train = ["the cat sat", "<UNK> the\tdog </S>", "a  cat <S> zebra", "the end"] * 3
    evaluated = ["the cat", "unknown words </S>", "<UNK> a"]
    for vocab in (Vocab.build(train), Vocab.build(train, max_size=5), Vocab.build(train, min_count=4)):
        expected = _unigram_reference(train, evaluated, vocab)
        assert unigram_perplexity(train, evaluated, vocab) == expected
        assert unigram_perplexity(WordCounts.of(train), evaluated, vocab) == expected
        assert unigram_perplexity(iter(train), evaluated, vocab) == expected
