import pytest

from moe_scale.data.text import holdout_split, load_sentences, load_splits, resolve_text_files, split_files
from moe_scale.errors import UserError


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
    assert len(splits["test"]) > 9000
