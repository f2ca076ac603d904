"""A run records the data files it trains on (size and a fingerprint of each); a resume on changed text is
refused in one line with nothing changed, and --accept-changed-data goes on with the change in the log and in
the record's history."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from moe_scale.config import DataConfig
from moe_scale.data.fingerprint import DATA_FILES, changes, fingerprint
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


def test_the_fingerprint_reads_both_ends_of_a_large_file(tmp_path):
    big = tmp_path / "train.txt"
    big.write_bytes(b"a b .\n" * 50_000)
    before = fingerprint(DataConfig(data=str(big)))
    big.write_bytes(b"a b .\n" * 49_999 + b"a c .\n")   # the last line only
    assert changes(before, fingerprint(DataConfig(data=str(big))))


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
