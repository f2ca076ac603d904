"""The embedded default corpus: a synthetic, word-level, topic-structured English-like language.

It lets `moe-scale` train out of the box with no download. It is generated, not shipped: a fixed seed and
`random.Random` (never the global RNG or `hash()`) give the same bytes on every machine, in a few seconds.

What a language model can learn from it (so a small LSTM ends far below the unigram perplexity):
- a Zipfian vocabulary of ~4000 word types: function words, then per-topic and shared content words;
- 16 topics, each with its own Zipfian distributions over nouns, verbs and adjectives, held for a run of
  consecutive sentences (a "document", with a focus noun that recurs) — something an MoE can specialise on;
- syntax: determiner–adjective–noun–verb–object–preposition templates, subject–verb number agreement
  (also across relative clauses), negation with do/does/did, coordinated and fronted clauses;
- collocations: adjectives prefer certain nouns, transitive verbs prefer certain objects.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from bisect import bisect
from itertools import accumulate
from pathlib import Path
from random import Random

from moe_scale.errors import UserError

EMBEDDED_NAME = "embedded"
SPLIT_WORDS = {"train": 1_200_000, "valid": 60_000, "test": 60_000}  # target word counts (without </S>)
_VERSION_DIR = "embedded-v1"  # bump when the generator's output changes

N_TOPICS = 16
TOPIC_NOUNS, TOPIC_VERBS, TOPIC_ADJS = 64, 32, 24  # content stems per topic
COMMON_NOUNS, COMMON_VERBS, COMMON_ADJS, ADVERBS = 80, 40, 40, 30

DET_SG = ["the", "a", "this", "that", "every", "each", "one", "no", "another", "her", "his", "its"]
DET_PL = ["the", "some", "these", "those", "many", "few", "two", "three", "all", "several", "their", "our"]
PRON_SG, PRON_PL = ["he", "she", "it"], ["they", "we"]
PREPS = ["in", "on", "with", "from", "near", "under", "over", "after", "before", "for", "about", "at", "by",
         "without", "across", "behind", "through", "beside"]
CONJS = ["and", "but", "because", "while", "although", "so", "when", "if", "until", "since"]
REPORT = ["said", "knew", "thought", "heard", "believed", "claimed", "noticed"]


def cache_root() -> Path:
    """Root of moe_scale's caches: $MOE_SCALE_CACHE, else ~/.cache/moe_scale."""
    env = os.environ.get("MOE_SCALE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moe_scale"


def embedded_corpus_dir() -> Path:
    """Directory with train.txt, valid.txt, test.txt of the embedded corpus, generated on first use.

    Written atomically (temp dir + os.replace): concurrent ranks and crashed runs never see half-written
    files; whichever process finishes first wins and the others reuse its files.
    """
    root = cache_root()
    final = root / _VERSION_DIR
    if all((final / f"{split}.txt").is_file() for split in SPLIT_WORDS):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_VERSION_DIR}.tmp-", dir=root))
    try:
        for split, sentences in generate_embedded_corpus().items():
            (tmp / f"{split}.txt").write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
        try:
            os.replace(tmp, final)
        except OSError:  # another process got there first (final exists and is not empty)
            if not all((final / f"{split}.txt").is_file() for split in SPLIT_WORDS):
                raise UserError(f"embedded corpus cache {final} is incomplete; delete that directory and "
                                "rerun to regenerate it") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


class _Dist:
    """A fixed discrete distribution over words, sampled with one uniform draw and a bisect."""

    def __init__(self, words: list[str], weights: list[float]):
        self.words, self.cum = words, list(accumulate(weights))
        self.total = self.cum[-1]

    def __call__(self, rng: Random) -> str:
        return self.words[min(bisect(self.cum, rng.random() * self.total), len(self.words) - 1)]


def _zipf(words: list[str], s: float = 1.0) -> _Dist:
    return _Dist(words, [1.0 / (r + 1) ** s for r in range(len(words))])


def _mix(a: _Dist, b: _Dist, p_a: float) -> _Dist:
    w: dict[str, float] = {}
    for d, p in ((a, p_a), (b, 1.0 - p_a)):
        prev = 0.0
        for word, c in zip(d.words, d.cum):
            w[word] = w.get(word, 0.0) + p * (c - prev) / d.total
            prev = c
    return _Dist(list(w), list(w.values()))  # dict keeps insertion order: deterministic


class _Lexicon:
    """Pseudo-word stems with all their inflected forms distinct from each other and from function words."""

    ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "t", "v", "z", "br", "cr", "dr", "gl", "pl",
              "st", "tr", "sh", "ch", "th", "gr", "fl", "sk", "w", "h", "j", "qu"]
    VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"]
    CODAS = ["", "", "", "n", "r", "l", "m", "k", "t", "nd", "rt", "x"]

    def __init__(self, rng: Random, reserved: list[str]):
        self.rng, self.used = rng, set(reserved)

    def stems(self, n: int, suffixes: list[str]) -> list[str]:
        out: list[str] = []
        while len(out) < n:
            r = self.rng
            stem = "".join(r.choice(self.ONSETS) + r.choice(self.VOWELS) for _ in range(r.choice([1, 2, 2, 3])))
            stem += r.choice(self.CODAS)
            forms = [stem + s for s in suffixes]
            if len(stem) >= 3 and not any(f in self.used for f in forms):
                self.used.update(forms)
                out.append(stem)
        return out


class _Topic:
    def __init__(self, rng: Random, nouns, verbs, adjs, common):
        c_nouns, c_verbs, c_adjs = common
        self.nouns = _mix(_zipf(nouns), c_nouns, 0.75)
        self.verbs = _mix(_zipf(verbs), c_verbs, 0.7)
        self.adjs = _mix(_zipf(adjs), c_adjs, 0.6)
        self.transitive = {v: rng.random() < 0.6 for v in self.verbs.words}
        # collocations: a verb's favourite objects, a noun's favourite adjectives (drawn from this topic)
        self.objects = {v: [self.nouns(rng) for _ in range(3)] for v in self.verbs.words}
        self.noun_adjs = {n: [self.adjs(rng) for _ in range(2)] for n in self.nouns.words}


class _Generator:
    def __init__(self, seed: int):
        rng = Random(seed)
        reserved = DET_SG + DET_PL + PRON_SG + PRON_PL + PREPS + CONJS + REPORT + [
            "that", "which", "does", "do", "did", "not", "will", "of", "very", ",", "."]
        lex = _Lexicon(rng, reserved)
        common = (_zipf(lex.stems(COMMON_NOUNS, ["", "s"])), _zipf(lex.stems(COMMON_VERBS, ["", "s", "ed"])),
                  _zipf(lex.stems(COMMON_ADJS, [""])))
        self.adverbs = _zipf(lex.stems(ADVERBS, ["ly"]))
        self.adverbs.words = [a + "ly" for a in self.adverbs.words]
        self.topics = [_Topic(rng, lex.stems(TOPIC_NOUNS, ["", "s"]), lex.stems(TOPIC_VERBS, ["", "s", "ed"]),
                              lex.stems(TOPIC_ADJS, [""]), common) for _ in range(N_TOPICS)]
        self.topic_dist = _zipf(list(range(N_TOPICS)), 0.5)
        self.det = {False: _zipf(DET_SG, 1.2), True: _zipf(DET_PL, 1.2)}
        self.preps, self.conjs, self.report = _zipf(PREPS), _zipf(CONJS), _zipf(REPORT)
        self.seed = seed

    # --- phrases: each appends words to `out`; `pl` is grammatical number ---------------------------
    def noun_phrase(self, rng: Random, out: list[str], t: _Topic, noun: str, pl: bool, depth: int = 0):
        out.append(self.det[pl](rng))
        if rng.random() < 0.4:
            if rng.random() < 0.1:
                out.append("very")
            out.append(rng.choice(t.noun_adjs[noun]) if rng.random() < 0.6 else t.adjs(rng))
        out.append(noun + "s" if pl else noun)
        if depth == 0 and rng.random() < 0.08:
            out.append("of")
            self.noun_phrase(rng, out, t, t.nouns(rng), rng.random() < 0.4, 1)

    def verb_phrase(self, rng: Random, out: list[str], t: _Topic, pl: bool):
        verb, u = t.verbs(rng), rng.random()
        if u < 0.1:
            out += ["did" if u < 0.03 else ("do" if pl else "does"), "not", verb]
        elif u < 0.17:
            out += ["will", verb]
        elif u < 0.45:
            out.append(verb + "ed")
        else:
            out.append(verb if pl else verb + "s")
        if t.transitive[verb]:
            obj = rng.choice(t.objects[verb]) if rng.random() < 0.55 else t.nouns(rng)
            self.noun_phrase(rng, out, t, obj, rng.random() < 0.35)
        if rng.random() < 0.12:
            out.append(self.adverbs(rng))
        if rng.random() < 0.3:
            out.append(self.preps(rng))
            self.noun_phrase(rng, out, t, t.nouns(rng), rng.random() < 0.3)

    def subject(self, rng: Random, out: list[str], t: _Topic, focus: str) -> bool:
        pl = rng.random() < 0.35
        if rng.random() < 0.15:
            out.append(rng.choice(PRON_PL if pl else PRON_SG))
        else:
            self.noun_phrase(rng, out, t, focus if rng.random() < 0.25 else t.nouns(rng), pl)
        return pl

    def clause(self, rng: Random, out: list[str], t: _Topic, focus: str):
        pl = self.subject(rng, out, t, focus)
        if rng.random() < 0.12 and out[-1] not in PRON_SG + PRON_PL:  # relative clause: agreement at a distance
            out.append(rng.choice(["that", "which"]))
            self.verb_phrase(rng, out, t, pl)
        self.verb_phrase(rng, out, t, pl)

    def sentence(self, rng: Random, t: _Topic, focus: str) -> str:
        out: list[str] = []
        u = rng.random()
        if u < 0.12:  # fronted prepositional phrase
            out.append(self.preps(rng))
            self.noun_phrase(rng, out, t, t.nouns(rng), rng.random() < 0.3)
            out.append(",")
            self.clause(rng, out, t, focus)
        elif u < 0.32:  # two clauses
            self.clause(rng, out, t, focus)
            out += [",", self.conjs(rng)]
            self.clause(rng, out, t, focus)
        elif u < 0.40:  # reported speech
            self.subject(rng, out, t, focus)
            out += [self.report(rng), "that"]
            self.clause(rng, out, t, focus)
        else:
            self.clause(rng, out, t, focus)
        out.append(".")
        return " ".join(out)

    def split(self, index: int, n_words: int) -> list[str]:
        rng = Random(self.seed * 10 + index)
        sentences: list[str] = []
        words = 0
        while words < n_words:
            t = self.topics[self.topic_dist(rng)]
            focus = t.nouns(rng)
            for _ in range(rng.randint(4, 14)):  # one document: one topic, one focus noun
                s = self.sentence(rng, t, focus)
                sentences.append(s)
                words += s.count(" ") + 1
        return sentences


def generate_embedded_corpus(seed: int = 20170123) -> dict[str, list[str]]:
    """split -> sentences (space-separated words), deterministic in `seed`; the lexicon is shared by splits."""
    gen = _Generator(seed)
    return {split: gen.split(i + 1, n) for i, (split, n) in enumerate(SPLIT_WORDS.items())}
