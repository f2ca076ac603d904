"""A run records the data files it trains on (size and the CRC-32 of each whole file); a resume on changed text
is refused in one line with nothing changed, and --accept-changed-data goes on with the change in the log and in
the record's history. An edit anywhere in a file is seen; an unchanged file is read once and then only stat'ed;
two ranks split the reading; an older run's record (the ends of each file) still compares."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from moe_scale.config import DataConfig
from moe_scale.data import fingerprint as fingerprint_module
from moe_scale.data.fingerprint import DATA_FILES, changes, check_resumed_data, edges_crc32, fingerprint
from tests.cli_runs import TINY, assert_one_line_error, run_cli, run_train, step_log

TEXT = "".join(f"w{i % 13} w{i % 7} w{i % 5} .\n" for i in range(400))


def _corpus(root: Path) -> Path:
    data = root / "data"
    data.mkdir()
    (data / "train.txt").write_text(TEXT)
    (data / "valid.txt").write_text("w1 w2 w3 .\n" * 20)
    (data / "test.txt").write_text("w3 w2 w1 .\n" * 20)
    return data


def test_changes_name_each_difference_and_a_moved_corpus_is_the_same(tmp_path):
    data = _corpus(tmp_path)
    before = fingerprint(DataConfig(data=str(data)))
    assert changes(before, before) == []
    moved = tmp_path / "elsewhere"
    shutil.copytree(data, moved)
    assert changes(before, fingerprint(DataConfig(data=str(moved)))) == []
    (data / "train.txt").write_text(TEXT + "w1 .\n")
    (data / "valid.txt").write_text("w1 w2 w4 .\n" * 20)   # same size, other words
    (data / "train_more.txt").write_text("w2 .\n")
    found = changes(before, fingerprint(DataConfig(data=str(data))))
    assert found == [f"train file {data / 'train_more.txt'} is new",
                     f"train file {data / 'train.txt'} had {len(TEXT)} bytes and has {len(TEXT) + 5}",
                     f"valid file {data / 'valid.txt'} has other content (220 bytes, as before)"]


def _reads(monkeypatch) -> list[str]:
    """The files fingerprint() reads whole from now on."""
    reads = []
    whole = fingerprint_module.whole_crc32
    monkeypatch.setattr(fingerprint_module, "whole_crc32", lambda path: reads.append(Path(path).name) or whole(path))
    return reads


def test_a_same_size_edit_in_the_middle_of_a_file_is_seen_and_an_unchanged_file_is_not_read_again(
        tmp_path, monkeypatch):
    """The issue's case: 200 lines in the middle of a 190 KB corpus, same size; then the same edit with the
    file's mtime set back (ctime still moves)."""
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path / "cache"))
    lines = [f"line {i:05d} of the corpus , words words words words words .\n" for i in range(3_200)]
    big = tmp_path / "train.txt"
    big.write_text("".join(lines))
    assert 180_000 < big.stat().st_size < 200_000
    reads = _reads(monkeypatch)
    before = fingerprint(DataConfig(data=str(big)))
    assert changes(before, fingerprint(DataConfig(data=str(big)))) == [] and reads == ["train.txt"]   # cached
    middle = lines[:1400] + [line.replace("words", "WORDS") for line in lines[1400:1600]] + lines[1600:]
    big.write_text("".join(middle))
    assert big.stat().st_size == len("".join(lines))
    assert changes(before, fingerprint(DataConfig(data=str(big)))) == [
        f"train file {big} has other content ({big.stat().st_size} bytes, as before)"]
    stat = big.stat()
    big.write_text("".join(lines[:1500] + [lines[1500].upper()] + lines[1501:]))
    os.utime(big, ns=(stat.st_atime_ns, stat.st_mtime_ns))   # mtime as before the edit
    assert changes(before, fingerprint(DataConfig(data=str(big))))
    assert reads == ["train.txt"] * 3


def test_a_record_of_an_older_version_compares_the_ends_of_each_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path / "cache"))
    data = _corpus(tmp_path)
    now = fingerprint(DataConfig(data=str(data)))
    old = {"format": 1, "splits": {split: [{**f, "crc32": edges_crc32(Path(f["path"]), f["bytes"])} for f in files]
                                   for split, files in now["splits"].items()}}
    assert check_resumed_data(old, now, accept=False) == []
    (data / "valid.txt").write_text("w1 w2 w4 .\n" * 20)   # same size
    assert check_resumed_data(old, fingerprint(DataConfig(data=str(data))), accept=True) == [
        f"valid file {data / 'valid.txt'} has other content (220 bytes, as before)"]


def _two_rank_fingerprint(rank: int, world_size: int, data: str, cache: str):
    reads = []
    whole = fingerprint_module.whole_crc32
    previous = os.environ.get("MOE_SCALE_CACHE")
    os.environ["MOE_SCALE_CACHE"] = f"{cache}-{rank}"
    fingerprint_module.whole_crc32 = lambda path: reads.append(Path(path).name) or whole(path)
    try:
        return fingerprint(DataConfig(data=data)), reads
    finally:
        fingerprint_module.whole_crc32 = whole
        os.environ.pop("MOE_SCALE_CACHE") if previous is None else os.environ.__setitem__("MOE_SCALE_CACHE", previous)


@pytest.mark.multiprocess
def test_two_ranks_split_the_reading_and_record_what_one_process_records(tmp_path, monkeypatch):
    from tests.multiproc import run_ranks

    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path / "cache"))
    data = _corpus(tmp_path)
    one = fingerprint(DataConfig(data=str(data)))
    (first, reads0), (second, reads1) = run_ranks(_two_rank_fingerprint, world_size=2,
                                                  args=(str(data), str(tmp_path / "rank-cache")))
    assert first == second == one
    assert sorted(reads0 + reads1) == ["test.txt", "train.txt", "valid.txt"] and reads0 and reads1


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_resume_on_replaced_text_is_refused_unless_accepted(tmp_path, embedded_cache):
    data, run = _corpus(tmp_path), tmp_path / "run"
    args = [*TINY, "--data", str(data), "--checkpoint-interval", "2", "--eval-interval", "100", "--out", str(run)]
    run_train([*args, "--max-steps", "2"], cwd=tmp_path, cache=embedded_cache)
    record = json.loads((run / DATA_FILES).read_text())
    assert [Path(f["path"]).name for f in record["splits"]["train"]] == ["train.txt"]
    assert "accepted" not in record

    (data / "train.txt").write_text("completely other text , about cats and dogs .\n" * 300)
    before = _hashes(run)
    proc = run_cli("train", "--resume", "--max-steps", "3", "--out", str(run), cwd=tmp_path, cache=embedded_cache)
    assert_one_line_error(proc, "the training data changed since this run started",
                          f"train file {data / 'train.txt'} had {len(TEXT)} bytes", "--accept-changed-data")
    assert _hashes(run) == before

    proc = run_train(["--resume", "--max-steps", "3", "--accept-changed-data", "--out", str(run)], cwd=tmp_path,
                     cache=embedded_cache)
    assert "resuming at step 2 on changed data (--accept-changed-data): train file" in proc.stdout
    assert [r["step"] for r in step_log(run)] == [1, 2, 3]
    record = json.loads((run / DATA_FILES).read_text())
    assert record["accepted"][0]["step"] == 2 and "train.txt" in record["accepted"][0]["changes"][0]
    assert json.loads((run / "config.json").read_text())["run"]["accept_changed_data"] is False
    # the accepted text is now the run's: a further resume on it needs no flag
    run_train(["--resume", "--max-steps", "4", "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
