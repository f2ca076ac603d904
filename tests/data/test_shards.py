"""Shards split over ranks x readers: disjoint and complete, at any byte cut; resumable line positions."""

from __future__ import annotations

from collections import Counter

import pytest

from moe_scale.data.shards import LineReader, plan_pieces
from moe_scale.errors import UserError


def _all_lines(files) -> Counter:
    return Counter(line.strip() for f in files for line in f.read_text(encoding="utf-8").splitlines()
                   if line.strip())


@pytest.mark.parametrize("ranks,readers", [(2, 1), (3, 1), (2, 2), (5, 1)])
def test_readers_get_disjoint_parts_that_cover_every_line(lm1b_benchmark, ranks, readers):
    files = sorted((lm1b_benchmark / "training-monolingual.tokenized.shuffled").iterdir())
    pieces = plan_pieces(files, ranks * readers)
    per_reader = [Counter(LineReader(p)) for p in pieces]
    total = sum(per_reader, Counter())
    assert total == _all_lines(files)                           # every line once: nothing lost or repeated
    assert sum(sum(c.values()) for c in per_reader) == sum(_all_lines(files).values())
    sizes = [sum(c.values()) for c in per_reader]
    assert min(sizes) > 0.5 * max(sizes)                         # roughly even
    resplit = len(files) % (ranks * readers) != 0
    assert all(len(p) == (len(files) if resplit else len(files) // (ranks * readers)) for p in pieces)


def test_byte_cuts_inside_lines_give_each_line_to_one_reader(tmp_path):
    f = tmp_path / "shard"
    lines = [("w%d " % i) * (1 + i % 7) for i in range(200)]
    f.write_text("\n".join(lines) + "\n")
    for readers in (3, 7, 13):
        got = [line for p in plan_pieces([f], readers) for line in LineReader(p)]
        assert got == [line.strip() for line in lines]         # in order, each once


def test_line_reader_resumes_where_it_stopped(lm1b_benchmark):
    files = sorted((lm1b_benchmark / "training-monolingual.tokenized.shuffled").iterdir())
    pieces = plan_pieces(files, 3)[1]
    everything = list(LineReader(pieces))
    reader = LineReader(pieces)
    it = iter(reader)
    first = [next(it) for _ in range(1234)]
    resumed = LineReader(pieces)
    resumed.load_state_dict(reader.state_dict())
    assert first + list(resumed) == everything


def test_empty_shard_skipped_with_a_log_line_and_bad_bytes_are_an_error(tmp_path, capsys):
    good, empty, bad = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    good.write_text("x y\n")
    empty.write_bytes(b"")
    bad.write_bytes(b"ok\nbad \xff byte\n")
    pieces = plan_pieces([good, empty], 1)
    assert f"moe-scale: skipping empty shard {empty}" in capsys.readouterr().err
    assert list(LineReader(pieces[0])) == ["x y"]
    with pytest.raises(UserError, match=r"not UTF-8 text \(invalid byte at offset 7\)"):
        list(LineReader(plan_pieces([bad], 1)[0]))
    with pytest.raises(UserError, match="all 1 training shard"):
        plan_pieces([empty], 2)
