"""tools/node_limited_rows.py: on 4 gloo ranks as 2 nodes x 2 (the pooled ranks of tests/multiproc.py, the tool's
own counting function), the node-limited gate bounds the rows that cross nodes: a token's experts on one rank
send at most one row anywhere, on one node at most one per rank of that node; unlimited top-k sends the most.
Flag errors are one line."""

from __future__ import annotations

import argparse
import sys

import pytest

from tests.multiproc import run_ranks
from tests.paths import TOOLS


def _tool():
    sys.path.insert(0, str(TOOLS))
    import node_limited_rows

    return node_limited_rows


def _rows_worker(rank: int, world: int) -> dict:
    tool = _tool()
    args = argparse.Namespace(node_size=2, experts=16, k=4, tokens=256, d=32, gate_logit_std=2.0, seed=1,
                              ranks=world)
    return {name: tool.rank_rows(rank, world, args, settings) for name, settings in tool.settings(args)}


@pytest.mark.multiprocess
def test_rows_crossing_nodes_fall_with_the_groups_a_token_may_use():
    per_rank = run_ranks(_rows_worker, world_size=4, deepspeed=True, timeout=90)
    rows = {name: sum(r[name][0] for r in per_rank) for name in per_rank[0]}
    tokens = sum(r["unlimited"][1] for r in per_rank)
    assert set(rows) == {"unlimited", "groups=ranks M=1", "groups=ranks M=2", "groups=nodes M=1"}
    assert rows["groups=ranks M=1"] <= tokens // 2 + tokens // 8   # one row a token, to the other node half the time
    assert rows["groups=ranks M=1"] < rows["groups=ranks M=2"] < rows["unlimited"]
    assert rows["groups=nodes M=1"] < rows["unlimited"] and rows["groups=nodes M=1"] <= tokens * 2


@pytest.mark.parametrize("flags", [["--ranks", "3"], ["--ranks", "2", "--node-size", "2"],
                                   ["--experts", "8", "--k", "4"], ["--k", "0"]])
def test_bad_flags_are_one_line(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        _tool().parse_args(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "error" in err[0], err
