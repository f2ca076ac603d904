import hashlib
import math
from collections import Counter

import numpy as np
import pytest

from moe_scale.data import embedded
from moe_scale.data.embedded import EMBEDDED_NAME, embedded_corpus_dir, generate_embedded_corpus
from moe_scale.data.vocab import Vocab, unigram_perplexity

# sha256 of the first 1000 training sentences ("\n"-joined) for the default seed: pins cross-machine determinism.
FIRST_1000_SHA256 = "8b2c8ca2f7db5fbc794fa35023ebe5f111290d3e0b30dacb2c44503521e5eefc"


@pytest.fixture(scope="module")
def corpus():
    return generate_embedded_corpus()


def _first_1000_sha(c):
    return hashlib.sha256("\n".join(c["train"][:1000]).encode()).hexdigest()


def test_deterministic(corpus):
    again = generate_embedded_corpus()
    assert again == corpus
    assert _first_1000_sha(corpus) == FIRST_1000_SHA256
    other = generate_embedded_corpus(seed=1)
    assert other["train"][:100] != corpus["train"][:100]


def test_sizes_and_words(corpus):
    n_words = {k: sum(len(s.split()) for s in v) for k, v in corpus.items()}
    assert 1_000_000 <= n_words["train"] <= 1_500_000
    assert 50_000 <= n_words["valid"] <= 80_000 and 50_000 <= n_words["test"] <= 80_000
    assert all(s and s == s.strip() and "  " not in s and "\n" not in s for v in corpus.values() for s in v)
    types = {w for s in corpus["train"] for w in s.split()}
    assert 3000 <= len(types) <= 6000
    assert not types & set(Vocab.SPECIALS)


def test_zipfian(corpus):
    freq = np.array(sorted(Counter(w for s in corpus["train"] for w in s.split()).values(), reverse=True), float)
    rank = np.arange(1, len(freq) + 1)
    slope = np.polyfit(np.log(rank[:2000]), np.log(freq[:2000]), 1)[0]
    assert -1.4 < slope < -0.8, slope


def _bigram_perplexity(train, evaluation, vocab, lam=0.9):
    """Bigram interpolated with the add-one unigram (a quick count-based model)."""
    uni, big, ctx = Counter(), Counter(), Counter()
    for s in train:
        ids = [Vocab.BOS_ID] + vocab.encode(s) + [Vocab.EOS_ID]
        uni.update(ids[1:])
        big.update(zip(ids, ids[1:]))
        ctx.update(ids[:-1])
    total = sum(uni.values()) + len(vocab)
    nll, n = 0.0, 0
    for s in evaluation:
        ids = [Vocab.BOS_ID] + vocab.encode(s) + [Vocab.EOS_ID]
        for a, b in zip(ids, ids[1:]):
            p_uni = (uni[b] + 1) / total
            p = lam * big[a, b] / ctx[a] + (1 - lam) * p_uni if ctx[a] else p_uni
            nll -= math.log(p)
            n += 1
    return math.exp(nll / n)


def test_structure_bigram_far_below_unigram(corpus):
    vocab = Vocab.build(corpus["train"])
    uni = unigram_perplexity(corpus["train"], corpus["valid"], vocab)
    bi = _bigram_perplexity(corpus["train"], corpus["valid"], vocab)
    assert uni > 150
    assert bi < 0.5 * uni, (bi, uni)


def test_topics_are_distinguishable(corpus):
    # Consecutive sentences (one document) share content words far more than random sentence pairs do.
    sents = [set(s.split()) for s in corpus["valid"]]
    function = {w for w, _ in Counter(w for s in corpus["train"][:20000] for w in s.split()).most_common(60)}
    sents = [s - function for s in sents]
    jac = lambda a, b: len(a & b) / max(1, len(a | b))  # noqa: E731
    adjacent = np.mean([jac(a, b) for a, b in zip(sents, sents[1:])])
    far = np.mean([jac(a, b) for a, b in zip(sents, sents[len(sents) // 2:])])
    assert adjacent > 3 * far, (adjacent, far)


def test_corpus_dir_written_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path))
    d = embedded_corpus_dir()
    assert d.parent == tmp_path
    assert sorted(p.name for p in d.iterdir()) == ["test.txt", "train.txt", "valid.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    lines = (d / "valid.txt").read_text(encoding="utf-8").splitlines()
    assert lines == generate_embedded_corpus()["valid"]
    mtime = (d / "train.txt").stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("regenerated although the corpus exists")

    monkeypatch.setattr(embedded, "generate_embedded_corpus", boom)
    assert embedded_corpus_dir() == d
    assert (d / "train.txt").stat().st_mtime_ns == mtime


def test_corpus_dir_lost_race_reuses_winner(tmp_path, monkeypatch):
    # Another process finishes first while we generate: our os.replace fails, we reuse its files.
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path))
    real = embedded.generate_embedded_corpus
    small = {"train": ["a b ."], "valid": ["c ."], "test": ["d ."]}

    def racing(*a, **k):
        final = tmp_path / "embedded-v1"
        final.mkdir()
        for split, s in small.items():
            (final / f"{split}.txt").write_text(s[0] + "\n")
        return {k: ["ours ."] for k in small}

    monkeypatch.setattr(embedded, "generate_embedded_corpus", racing)
    d = embedded_corpus_dir()
    assert (d / "train.txt").read_text() == "a b .\n"
    assert [p.name for p in tmp_path.iterdir()] == ["embedded-v1"]
    assert real is generate_embedded_corpus
    assert EMBEDDED_NAME == "embedded"


def test_incomplete_cache_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "generate_embedded_corpus", lambda: {"train": ["a ."], "valid": [], "test": []})
    (tmp_path / "embedded-v1").mkdir()
    (tmp_path / "embedded-v1" / "train.txt").write_text("a .\n")
    with pytest.raises(embedded.UserError, match="delete that directory"):
        embedded_corpus_dir()
