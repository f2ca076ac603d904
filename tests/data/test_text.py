from pathlib import Path

import pytest

from moe_scale.data.text import holdout_split, load_sentences, load_splits, resolve_text_files, split_files
from moe_scale.errors import UserError
from tests.wikitext import wikitext_sentences


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path / "cache"))


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_resolve_file_dir_glob(tmp_path):
    d = tmp_path / "d"
    b = _write(d / "b.txt", "x y\n")
    a = _write(d / "a.txt", "z\n")
    _write(d / ".hidden", "h\n")
    _write(d / "sub" / "c.txt", "not recursive\n")
    assert resolve_text_files(str(b)) == [b]
    assert resolve_text_files(str(d)) == [a, b]
    assert resolve_text_files(str(d / "*.txt")) == [a, b]


def test_resolve_lm1b_glob(lm1b_shards):
    files = resolve_text_files(str(lm1b_shards / "training" / "news.en-*-of-00004"))
    assert [f.name for f in files] == [f"news.en-{k:05d}-of-00004" for k in range(4)]


@pytest.mark.parametrize("case", ["missing", "empty_dir", "no_match", "blank_files"])
def test_resolve_errors_name_the_path(tmp_path, case):
    if case == "missing":
        spec, match = tmp_path / "nope.txt", "no such file"
    elif case == "empty_dir":
        (tmp_path / "empty").mkdir()
        _write(tmp_path / "empty" / ".hidden", "x\n")
        spec, match = tmp_path / "empty", "no .*files"
    elif case == "no_match":
        spec, match = tmp_path / "news.en-*-of-00100", "no files match"
    else:
        _write(tmp_path / "blank" / "a.txt", "")
        _write(tmp_path / "blank" / "b.txt", "\n   \n\t\n")
        spec, match = tmp_path / "blank", "empty or blank"
    with pytest.raises(UserError, match=match) as e:
        resolve_text_files(str(spec), what="--eval-data")
    msg = str(e.value)
    assert msg.startswith(f"--eval-data {spec}") and ";" in msg and "\n" not in msg


def test_split_files_wikitext_layout(tmp_path):
    d = tmp_path / "wikitext"
    for s in ["train", "valid", "test"]:
        _write(d / f"{s}.txt", f"{s} words\n")
    _write(d / "README.md", "not data\n")
    assert split_files(str(d)) == {s: [d / f"{s}.txt"] for s in ["train", "valid", "test"]}
    # wikitext-103 raw naming
    d2 = tmp_path / "wt103"
    for s in ["train", "valid", "test"]:
        _write(d2 / f"wiki.{s}.tokens", f"{s}\n")
    assert split_files(str(d2))["valid"] == [d2 / "wiki.valid.tokens"]


def test_split_files_lm1b_layout(lm1b_shards):
    out = split_files(str(lm1b_shards))
    assert [f.name for f in out["train"]] == [f"news.en-{k:05d}-of-00004" for k in range(4)]
    assert out["valid"] == [] and [f.name for f in out["test"]] == ["news.en.heldout-00000-of-00001"]
    glob_only = split_files(str(lm1b_shards / "training" / "news.en-*"))
    assert len(glob_only["train"]) == 4 and glob_only["valid"] == glob_only["test"] == []
    flat = split_files(str(lm1b_shards / "training"))
    assert len(flat["train"]) == 4 and flat["valid"] == flat["test"] == []


def test_split_files_embedded(embedded_cache, monkeypatch):
    monkeypatch.setenv("MOE_SCALE_CACHE", str(embedded_cache))
    out = split_files("embedded")
    assert [f.name for fs in out.values() for f in fs] == ["train.txt", "valid.txt", "test.txt"]
    assert all(f.is_file() for fs in out.values() for f in fs)


def test_load_sentences_order_strip_and_drop_empty(tmp_path):
    f2 = _write(tmp_path / "b.txt", "  first of b  \n\n\nsecond of b\n")
    f1 = _write(tmp_path / "a.txt", "only a\n   \n")
    ds = load_sentences([f2, f1])
    assert list(ds["text"]) == ["first of b", "second of b", "only a"]
    assert (tmp_path / "cache" / "hf").is_dir()


def test_holdout_split_sizes(tmp_path):
    f = _write(tmp_path / "t.txt", "".join(f"s {i}\n" for i in range(1000)))
    ds = load_sentences([f])
    train, valid, test = holdout_split(ds, 0.1)
    assert (len(train), len(valid), len(test)) == (900, 50, 50)
    assert train["text"][-1] == "s 899" and valid["text"][0] == "s 900" and test["text"][0] == "s 950"
    with pytest.raises(UserError, match="hold out"):
        holdout_split(ds.select(range(5)), 0.1)
    with pytest.raises(UserError, match="between 0 and 1"):
        holdout_split(ds, 1.5)


def test_load_splits_lm1b_cuts_valid_from_train(lm1b_shards):
    splits = load_splits(str(lm1b_shards), holdout_fraction=0.02)
    n_train_file = len(load_sentences(split_files(str(lm1b_shards))["train"]))
    assert len(splits["train"]) + len(splits["valid"]) == n_train_file
    assert len(splits["valid"]) == round(n_train_file * 0.01)
    assert len(splits["test"]) > 1000   # the heldout shard: an eighth of WikiText-2 test


def test_held_out_files_without_training_files_are_refused(tmp_path):
    """valid.txt and test.txt but no train*: all three were once read as training text, test text included."""
    d = tmp_path / "corpus"
    _write(d / "valid.txt", "a b .\n")
    _write(d / "test.txt", "c d .\n")
    with pytest.raises(UserError, match=r"held-out files \(test.txt, valid.txt\) but no training files; the rule"):
        split_files(str(d))


def test_files_beside_the_split_rule_are_refused_but_documentation_is_not(tmp_path):
    d = tmp_path / "corpus"
    for name in ("train.txt", "valid.txt", "README", "notes.md"):
        _write(d / name, "a b .\n")
    assert [f.name for f in split_files(str(d))["train"]] == ["train.txt"]
    _write(d / "extra.txt", "c d .\n")
    with pytest.raises(UserError, match=r"some files follow the split rule .* \(extra.txt\)"):
        split_files(str(d))


@pytest.mark.parametrize("names, expected", [
    (["kjv.train.txt", "kjv.valid.txt", "kjv.test.txt"], ("kjv.train.txt", "kjv.valid.txt", "kjv.test.txt")),
    (["Train_A.txt", "dev-00.txt", "HELDOUT.txt"], ("Train_A.txt", "dev-00.txt", "HELDOUT.txt")),
    (["training", "validation.txt", "news.en.heldout-00000-of-00050"],
     ("training", "validation.txt", "news.en.heldout-00000-of-00050")),
])
def test_the_split_rule_is_a_word_of_the_name(tmp_path, names, expected):
    """What docs/data.md and the refusals state: a word of the name (cut at . _ -, any case), not a prefix."""
    d = tmp_path / "corpus"
    for name in names:
        _write(d / name / "part.txt" if "." not in name else d / name, "a b .\n")
    found = split_files(str(d))
    assert tuple((found[s][0].parent if found[s][0].parent != d else found[s][0]).name
                 for s in ("train", "valid", "test")) == expected


def test_a_prefix_is_not_the_split_rule_and_the_refusal_says_so(tmp_path):
    d = tmp_path / "corpus"
    _write(d / "trainset.txt", "a b .\n")
    _write(d / "test.txt", "c d .\n")
    refusals = []
    for start in ("held-out files (test.txt) but no training files; the rule: a file or directory belongs",
                  "some files follow the split rule and some do not (trainset.txt)"):
        with pytest.raises(UserError) as refused:
            split_files(str(d))
        refusals.append(str(refused.value))
        assert start in refusals[-1], refusals[-1]
        _write(d / "train.txt", "e f .\n")   # the second: a training file beside a name no rule takes
    for message in refusals:
        for part in ("cut at '.', '_' and '-'", "kjv.train.txt", "valid, validation or dev", "test or heldout",
                     "not a prefix (trainset.txt is in no split)"):
            assert part in message, message


def _layouts(root: Path, lm1b_shards: Path, lm1b_benchmark: Path) -> dict[str, dict]:
    """Every --data layout the docs list, as DataConfig settings."""
    wiki = root / "wikitext"
    for split, text in (("train", "valid"), ("valid", "test"), ("test", "test")):
        _write(wiki / f"{split}.txt", "\n".join(wikitext_sentences(text)[:300 if split == "test" else 3000]))
    single = _write(root / "single.txt", "\n".join(wikitext_sentences("valid")[:4000]))
    held = [_write(root / f"held-{k}.txt", "\n".join(wikitext_sentences("test")[k * 500:(k + 1) * 500]))
            for k in range(2)]
    return {
        "one file, held out": {"data": str(single)},
        "train/valid/test files": {"data": str(wiki)},
        "lm1b-style training/ heldout/": {"data": str(lm1b_shards)},
        "the 1B-word benchmark": {"data": str(lm1b_benchmark)},
        "a glob": {"data": str(lm1b_shards / "training" / "news.en-*")},
        "a directory of shards": {"data": str(lm1b_shards / "training")},
        "--valid-data and --test-data": {"data": str(single), "valid_data": str(held[0]), "test_data": str(held[1])},
    }


def test_no_layout_reads_a_file_or_sentence_in_two_splits(tmp_path, lm1b_shards, lm1b_benchmark):
    from moe_scale.config import DataConfig
    from moe_scale.train.data_setup import load_run_splits

    for name, settings in _layouts(tmp_path, lm1b_shards, lm1b_benchmark).items():
        config = DataConfig(**settings)
        files = split_files(config.data)
        named = {split: {f.resolve() for f in files[split]} for split in files}
        assert not (named["train"] & (named["valid"] | named["test"])), name
        train, valid, test = load_run_splits(config)
        # held out from one text: the splits are disjoint ranges of its sentences
        texts = {split: list(ds["text"]) for split, ds in (("train", train), ("valid", valid), ("test", test))}
        if not named["valid"] and not named["test"] and not config.valid_data:
            everything = list(load_sentences(files["train"])["text"])
            n_train = len(texts["train"])
            assert texts["train"] == everything[:n_train], name
            assert texts["valid"] + texts["test"] == everything[n_train:], name
        assert texts["train"] and texts["valid"] and texts["test"], name
