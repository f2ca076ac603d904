"""Subword tokenizers (HuggingFace `tokenizers`): a byte-level BPE trained on the training text (`--tokenizer
bpe`) or an existing tokenizer.json (`--tokenizer PATH`), with the word vocabulary's interface (data/vocab.py).

Ids 0, 1, 2 are <UNK>, <S>, </S> as in the word vocabulary, so the windows, the models and the exported HF
tokenizer need no second convention: a trained BPE has them as its first special tokens; a loaded tokenizer.json
whose ids 0-2 are something else has every id moved up by 3 (`_with_our_specials`). A byte-level BPE encodes
any text: nothing becomes <UNK>.

Perplexity stays per word: `word_starts` marks, per token, how many whitespace words begin at it, so the
evaluation divides the total NLL by the text's word count (data/eval_windows.py) whatever the tokenizer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Iterable

from moe_scale.data.vocab import Vocab
from moe_scale.errors import UserError
from moe_scale.files import write_text_atomic
from moe_scale.run_files import RunFiles

TOKENIZER_FILE = RunFiles.TOKENIZER   # in the run directory, for subword runs (word runs keep `vocab`)
_BYTES = 256
MIN_TOKENS_PER_WORD = 0.5   # fewer: the tokenizer drops text it has no token for
# Characters outside most tokenizers' alphabets: each must come out as tokens (bytes, pieces or the unknown token).
_PROBE = "Zürich ÿ ß 漢字 🙂 ∑ ж"


class SubwordTokenizer:
    UNK, BOS, EOS, SPECIALS = Vocab.UNK, Vocab.BOS, Vocab.EOS, Vocab.SPECIALS
    UNK_ID, BOS_ID, EOS_ID = Vocab.UNK_ID, Vocab.BOS_ID, Vocab.EOS_ID
    counts = None   # no training counts: --sampler unigram needs the word vocabulary

    def __init__(self, tokenizer):
        if [tokenizer.id_to_token(i) for i in range(3)] != list(self.SPECIALS):
            raise ValueError(f"ids 0-2 must be {self.SPECIALS}")
        self.tokenizer = tokenizer

    # ------------------------------------------------------------------ building
    @classmethod
    def train_bpe(cls, sentences: Iterable[str], vocab_size: int, min_count: int = 1) -> "SubwordTokenizer":
        """A byte-level BPE of `vocab_size` ids (the 3 specials and 256 bytes included) learned from `sentences`."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < len(cls.SPECIALS) + _BYTES + 1:
            raise UserError(f"--tokenizer bpe needs --vocab-size of at least {len(cls.SPECIALS) + _BYTES + 1} "
                            f"(3 special tokens, 256 bytes and one merge); got {vocab_size}")
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_count, show_progress=False,
                                      special_tokens=list(cls.SPECIALS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(sentences, trainer)
        return cls(tokenizer)

    @classmethod
    def from_json(cls, text: str) -> "SubwordTokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(text))

    @classmethod
    def from_user_file(cls, path: Path) -> "SubwordTokenizer":
        """--tokenizer PATH: a tokenizer.json written by HF `tokenizers` (or `save_pretrained`)."""
        from tokenizers import Tokenizer

        path = Path(path)
        fix = "pass a tokenizer.json saved by HuggingFace tokenizers, or --tokenizer words|bpe"
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"--tokenizer {path}: no such file; {fix}") from None
        except IsADirectoryError:
            raise UserError(f"--tokenizer {path}: is a directory; point to its tokenizer.json") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"--tokenizer {path}: not a tokenizer.json ({e}); {fix}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
            raise UserError(f"--tokenizer {path}: not a tokenizer.json (no 'model' object); {fix}")
        try:
            tokenizer = Tokenizer.from_str(json.dumps(spec))
        except Exception as e:   # tokenizers raises its own Exception types
            raise UserError(f"--tokenizer {path}: HF tokenizers cannot load it ({str(e).splitlines()[0]}); "
                            f"{fix}") from None
        if [tokenizer.id_to_token(i) for i in range(3)] == list(cls.SPECIALS):
            return cls(tokenizer)
        return cls(Tokenizer.from_str(json.dumps(_with_our_specials(spec, path))))

    def check_user_file(self, path: str, sentences: list[str]) -> None:
        """--tokenizer PATH must turn text into tokens without losing any: it encodes a sample of the training text
        (`sentences`) without an error, at MIN_TOKENS_PER_WORD or more tokens per word, and characters outside
        its alphabet become bytes or its unknown token, not nothing."""
        fix = "use a tokenizer.json with an unknown token or byte fallback, or --tokenizer bpe"
        try:
            encoded = self.tokenizer.encode_batch(sentences, add_special_tokens=False)
            probe = self.tokenizer.encode(_PROBE, add_special_tokens=False)
        except Exception as e:   # tokenizers raises its own Exception types (a WordLevel without its unk token)
            raise UserError(f"--tokenizer {path} cannot encode the training text (tokenizers: "
                            f"{str(e).splitlines()[0]}); {fix}") from None
        words = sum(len(sentence.split()) for sentence in sentences)
        per_word = sum(len(e.ids) for e in encoded) / max(words, 1)
        if per_word < MIN_TOKENS_PER_WORD:
            raise UserError(f"--tokenizer {path} gives {per_word:.2f} tokens per word of the training text (at "
                            f"least {MIN_TOKENS_PER_WORD} expected): it drops the text it has no tokens for; {fix}")
        covered = {i for start, end in probe.offsets for i in range(start, end)}
        dropped = [c for i, c in enumerate(_PROBE) if not c.isspace() and i not in covered]
        if dropped:
            raise UserError(f"--tokenizer {path} has no token for {', '.join(repr(c) for c in dropped[:4])} and no "
                            f"unknown token, so such characters would vanish from training and evaluation; {fix}")

    @classmethod
    def load(cls, path: Path) -> "SubwordTokenizer":
        """The run directory's tokenizer.json."""
        path = Path(path)
        try:
            return cls.from_json(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"{path} is missing; the run directory is incomplete, start a new run") from None
        except Exception as e:
            raise UserError(f"{path} cannot be loaded ({str(e).splitlines()[0]}); restore it from a copy of the "
                            f"run, or start a new run") from None

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def save(self, path: Path) -> None:
        write_text_atomic(Path(path), self.to_json())

    # ------------------------------------------------------------------ the vocabulary's interface
    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, sentence: str) -> list[int]:
        """Text -> ids; no <S> or </S> added."""
        return self.tokenizer.encode(sentence, add_special_tokens=False).ids

    def encode_many(self, sentences: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(sentences, add_special_tokens=False)]

    def encode_with_word_starts(self, sentence: str) -> tuple[list[int], list[int]]:
        """(ids, starts): starts[i] = how many whitespace words begin at token i (between the end of token i-1 and
        the end of token i); words after the last token are counted on it, so sum(starts) = the word count."""
        encoding = self.tokenizer.encode(sentence, add_special_tokens=False)
        word_begins = _word_begins(sentence)
        starts, w = [], 0
        for _, end in encoding.offsets:
            n = 0
            while w < len(word_begins) and word_begins[w] < end:
                n, w = n + 1, w + 1
            starts.append(n)
        if starts:
            starts[-1] += len(word_begins) - w
        return encoding.ids, starts

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    @functools.cached_property
    def words(self) -> list[str]:
        """Every token as it reads (a byte-level BPE's 'Ġthe' reads ' the'): expert reports, generate."""
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in range(len(self))]

    def token_text(self, token_id: int) -> str:
        return self.words[token_id]


def _word_begins(sentence: str) -> list[int]:
    begins, inside = [], False
    for i, c in enumerate(sentence):
        if c.isspace():
            inside = False
        elif not inside:
            begins.append(i)
            inside = True
    return begins


def _with_our_specials(spec: dict, path: Path) -> dict:
    """The tokenizer with <UNK>, <S>, </S> at ids 0-2 and every other id 3 higher (its own special tokens keep
    their places, moved up; a post-processor, padding or truncation, which name ids, are dropped: moe_scale adds
    <S> and </S> itself)."""
    model = dict(spec["model"])
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        taken = [t for t in Vocab.SPECIALS if t in vocab]
        model["vocab"] = {**{t: i for i, t in enumerate(Vocab.SPECIALS)}, **{t: i + 3 for t, i in vocab.items()}}
    elif isinstance(vocab, list):   # Unigram: [[piece, score], ...]
        taken = [t for t in Vocab.SPECIALS if any(p[0] == t for p in vocab)]
        model["vocab"] = [[t, 0.0] for t in Vocab.SPECIALS] + vocab
        if model.get("unk_id") is not None:
            model["unk_id"] += 3
    else:
        raise UserError(f"--tokenizer {path}: its model ({model.get('type')}) has no vocabulary moe_scale can "
                        f"renumber; use a BPE, WordPiece, WordLevel or Unigram tokenizer.json, or --tokenizer bpe")
    if taken:
        raise UserError(f"--tokenizer {path}: it has {', '.join(taken)} at other ids than 0-2 (moe_scale's "
                        f"<UNK>, <S>, </S>); rename those tokens, or use --tokenizer bpe")
    added = [{**t, "id": t["id"] + 3} for t in spec.get("added_tokens") or []]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(Vocab.SPECIALS)] + added
    return {**spec, "model": model, "added_tokens": added, "post_processor": None, "padding": None,
            "truncation": None}


def load_run_tokenizer(run: Path) -> "Vocab | SubwordTokenizer":
    """A run directory's tokenizer: its tokenizer.json (subword runs), else its word vocabulary."""
    run = Path(run)
    if (run / TOKENIZER_FILE).is_file():
        return SubwordTokenizer.load(run / TOKENIZER_FILE)
    return Vocab.load(RunFiles(run).vocab)


def save_run_tokenizer(tokenizer: "Vocab | SubwordTokenizer", run: Path) -> None:
    run = Path(run)
    if isinstance(tokenizer, SubwordTokenizer):
        tokenizer.save(run / TOKENIZER_FILE)
    else:
        tokenizer.save(RunFiles(run).vocab)
