"""User text paths -> files per split -> sentence datasets (HuggingFace `datasets`, one sentence per line)."""

from __future__ import annotations

import glob
import re
import sys
from pathlib import Path

import datasets
from datasets import Dataset

from moe_scale.data.embedded import EMBEDDED_NAME, cache_root, embedded_corpus_dir
from moe_scale.errors import UserError
from moe_scale.files import special_kind

SPLITS = ("train", "valid", "test")
# A file or subdirectory name with one of these words (split at . _ -) belongs to that split.
# `heldout` is lm1b's name for its test shards (Shazeer et al. 2017 evaluate on them).
_SPLIT_WORDS = {"train": "train", "training": "train", "valid": "valid", "validation": "valid", "dev": "valid",
                "test": "test", "heldout": "test"}
# The rule as every refusal states it (docs/data.md#data says the same).
SPLIT_RULE = ("a file or directory belongs to a split when its name, cut at '.', '_' and '-' (any case), holds the "
              "word train or training (train), valid, validation or dev (valid), or test or heldout (test): "
              "train.txt, kjv.train.txt, dev-00.txt, news.en.heldout-00000-of-00050; a word, not a prefix "
              "(trainset.txt is in no split)")
_GLOB_CHARS = re.compile(r"[*?\[]")


def unreadable_error(path: Path, error: OSError) -> UserError:
    return UserError(f"{path}: cannot be read ({error.strerror or error}); check its permissions and the disk, "
                     "or remove it from the data")


def _has_words(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 16):
                if chunk.strip():
                    return True
    except OSError as e:
        raise unreadable_error(path, e) from None
    return False


def _visible_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))


def resolve_text_files(spec: str, what: str = "--data") -> list[Path]:
    """A file, a directory (its regular, non-hidden files, sorted; not recursive) or a glob -> sorted files."""
    path = Path(spec).expanduser()
    if _GLOB_CHARS.search(spec) and not path.exists():
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
        if not files:
            raise UserError(f"{what} {spec}: no files match this pattern; check the directory and the pattern")
    elif path.is_dir():
        files = _visible_files(path)
        if not files:
            raise UserError(f"{what} {spec}: directory has no (non-hidden) files; put text files in it "
                            "(one sentence per line) or point to another directory")
    elif path.is_file():
        files = [path]
    elif kind := special_kind(path):
        raise UserError(f"{what} {spec} is {kind}, not a regular file: training reads its text more than once "
                        f"(the vocabulary, then the batches); save the text to a file and pass that")
    else:
        raise UserError(f"{what} {spec}: no such file or directory; check the path")
    if not any(_has_words(f) for f in files):
        raise UserError(f"{what} {spec}: all {len(files)} file(s) are empty or blank; "
                        "provide text with one sentence per line")
    return files


def _split_of(name: str) -> str | None:
    return next((_SPLIT_WORDS[w] for w in re.split(r"[._\-]", name.lower()) if w in _SPLIT_WORDS), None)


def _is_documentation(name: str) -> bool:
    """README, LICENSE and the like beside a corpus's splits (lm1b's root holds a README): never text to train on."""
    return name.upper().startswith(("README", "LICENSE", "LICENCE", "COPYING")) or name.endswith((".md", ".html"))


def split_files(spec: str) -> dict[str, list[Path]]:
    """Train/valid/test files for a --data spec (missing splits are []; see `load_splits`).

    - "embedded": the embedded corpus;
    - a directory whose files or subdirectories are named by SPLIT_RULE (a word of the name, cut at . _ -, is
      train/training, valid/validation/dev or test/heldout): those (wikitext: train.txt valid.txt test.txt;
      kjv.train.txt; lm1b: training-monolingual.../ heldout-monolingual.../); held-out files without training
      files, or files beside them that follow no rule, are refused (no text may be read as the wrong split);
    - anything else (file, directory of shards, glob): all training files.
    """
    if spec == EMBEDDED_NAME:
        d = embedded_corpus_dir()
        return {s: [d / f"{s}.txt"] for s in SPLITS}
    path = Path(spec).expanduser()
    if path.is_dir() and not _GLOB_CHARS.search(spec):
        out: dict[str, list[Path]] = {s: [] for s in SPLITS}
        for entry in sorted(p for p in path.iterdir() if not p.name.startswith(".")):
            split = _split_of(entry.name)
            if split is not None and entry.is_dir():
                out[split] += resolve_text_files(str(entry), f"--data {split} directory")
            elif split is not None and entry.is_file():
                out[split].append(entry)
            elif split is not None and (kind := special_kind(entry)):
                raise UserError(f"--data {spec}: {entry.name} is {kind}, not a regular file: training reads its "
                                f"text more than once; save the text to a file and pass that")
        named = sorted((f for files in out.values() for f in files), key=lambda f: f.name)
        unnamed = sorted(p.name for p in path.iterdir() if not p.name.startswith(".") and _split_of(p.name) is None
                         and not _is_documentation(p.name))
        if named and not out["train"]:
            raise UserError(f"--data {spec}: held-out files ({', '.join(f.name for f in named[:3])}) but no training "
                            f"files; the rule: {SPLIT_RULE}. Name the training text by it (train.txt), or pass it "
                            f"as --data and these as --valid-data/--test-data")
        if named and unnamed:
            raise UserError(f"--data {spec}: some files follow the split rule and some do not "
                            f"({', '.join(unnamed[:3])}); move those away or rename them by the rule so no text is "
                            f"read as the wrong split (the rule: {SPLIT_RULE})")
        if out["train"]:
            if not any(_has_words(f) for f in out["train"]):
                raise UserError(f"--data {spec}: the training files are empty; provide text, one sentence per line")
            return conventional_lm1b_splits(spec, path, out)
    return {"train": resolve_text_files(spec), "valid": [], "test": []}


_LM1B_HELDOUT = re.compile(r"news\.en\.heldout-(\d+)-of-(\d+)$")


def conventional_lm1b_splits(spec: str, path: Path, out: dict[str, list[Path]]) -> dict[str, list[Path]]:
    """The 1B-word benchmark's convention: test perplexity is over heldout shard 00000 only; the next
    held-out shard (if no valid files were given) is the validation split (one shard, ~160k words: a
    validation pass stays short; the other 48 are left unused). lm1b's training directory
    (training-monolingual*) without a held-out directory is an error, not a silent held-out part of train."""
    if any(p.name.startswith("training-monolingual") for p in path.iterdir()) and not out["test"]:
        raise UserError(f"--data {spec}: lm1b training shards but no held-out split (heldout-monolingual*/"
                        "news.en.heldout-*); the standard perplexity is over news.en.heldout-00000-of-00050: "
                        "put the heldout directory beside the training one, or pass --test-data")
    heldout = {int(m.group(1)): f for f in out["test"] if (m := _LM1B_HELDOUT.search(f.name))}
    if len(heldout) == len(out["test"]) and len(heldout) > 1 and 0 in heldout:
        rest = [f for k, f in sorted(heldout.items()) if k != 0]
        out = {**out, "test": [heldout[0]], "valid": out["valid"] or rest[:1]}
    return out


def _first_bad_utf8(path: Path) -> int | None:
    """Byte offset of the first invalid UTF-8 sequence in the file, or None (reads it in 1 MiB pieces)."""
    import codecs
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as e:
                    return offset + e.start
                offset += len(chunk)
    except OSError as e:
        raise unreadable_error(path, e) from None
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return offset
    return None


def not_utf8_error(path: Path, offset: int) -> UserError:
    return UserError(f"{path}: not UTF-8 text (invalid byte at offset {offset}); convert it (e.g. "
                     f"`iconv -f latin1 -t utf-8`) or remove it from the data")


def _hf_cache_dir() -> str:
    d = cache_root() / "hf"
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def load_sentences(files: list[Path]) -> Dataset:
    """One sentence per line, stripped, empty lines dropped; files in the given order, lines in file order."""
    if not files:
        raise ValueError("load_sentences needs at least one file")
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    nonempty = [f for f in files if _has_words(Path(f))]
    for f in files:
        if f not in nonempty:
            print(f"moe-scale: skipping empty shard {f}", file=sys.stderr)
    if not nonempty:
        raise UserError(f"all {len(files)} file(s) are empty or blank ({files[0]} ...); "
                        "provide text with one sentence per line")
    try:
        ds = datasets.load_dataset("text", data_files=[str(Path(f).resolve()) for f in nonempty], split="train",
                                   cache_dir=_hf_cache_dir())
    except datasets.exceptions.DatasetGenerationError:
        for f in nonempty:   # the usual cause: a file that is not UTF-8; name it
            if (offset := _first_bad_utf8(Path(f))) is not None:
                raise not_utf8_error(Path(f), offset) from None
        raise
    return ds.map(_stripped_nonempty, batched=True)   # one table, no indices mapping (as `filter` would leave)


def _stripped_nonempty(batch: dict) -> dict:
    lines = (t.strip() for t in batch["text"])
    return {"text": [t for t in lines if t]}


def holdout_split(ds: Dataset, fraction: float) -> tuple[Dataset, Dataset, Dataset]:
    """(train, valid, test): the last `fraction` of sentences split equally into valid then test."""
    if not 0.0 < fraction < 1.0:
        raise UserError(f"holdout fraction {fraction} is out of range; use a value between 0 and 1, e.g. 0.02")
    n = len(ds)
    n_hold = int(round(n * fraction))
    if n_hold < 2 or n_hold >= n:
        raise UserError(f"cannot hold out {fraction:g} of {n} sentences for valid and test; give more data, "
                        "a larger holdout fraction, or separate valid/test files")
    n_train, n_valid = n - n_hold, n_hold // 2
    return (ds.select(range(n_train)), ds.select(range(n_train, n_train + n_valid)),
            ds.select(range(n_train + n_valid, n)))


def load_splits(spec: str, holdout_fraction: float = 0.02) -> dict[str, Dataset]:
    """split -> sentences for a --data spec; splits without files are cut from the end of the training data
    (both missing: `holdout_split`; one missing: the last `holdout_fraction / 2` of train)."""
    files = split_files(spec)
    train = load_sentences(files["train"])
    valid = load_sentences(files["valid"]) if files["valid"] else None
    test = load_sentences(files["test"]) if files["test"] else None
    if valid is None and test is None:
        train, valid, test = holdout_split(train, holdout_fraction)
    elif valid is None or test is None:
        n = len(train)
        n_hold = int(round(n * holdout_fraction / 2))
        if n_hold < 1 or n_hold >= n:
            raise UserError(f"--data {spec}: cannot hold out {holdout_fraction / 2:g} of {n} training sentences "
                            "for the missing valid/test split; give more data or valid and test files")
        held = train.select(range(n - n_hold, n))
        train = train.select(range(n - n_hold))
        valid, test = (held, test) if valid is None else (valid, held)
    return {"train": train, "valid": valid, "test": test}


def sentence_texts(ds: Dataset) -> list[str]:
    """All sentences as a list, read in one batch (iterating a `datasets` column goes row by row: ~300x slower)."""
    return ds[:]["text"] if len(ds) else []
