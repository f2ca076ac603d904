"""tools/table6.py end to end at a tiny size (rows 0 and 3, 3 steps) and its flag errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.paths import TOOLS

TOOL = TOOLS / "table6.py"
TINY = ["--extra", "--d-model", "16", "--expert-hidden", "16", "--seq-len", "8", "--batch-size", "8",
        "--eval-max-batches", "2", "--vocab-size", "500"]
NUM = r"(-?\d+\.\d+)"


def _run(*flags: str, timeout: int = 80) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *flags], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_table6_two_rows_tiny(tmp_path, wikitext_dir):
    out = tmp_path / "t6"
    proc = _run("--out", str(out), "--only", "0,3", "--max-steps", "3", "--num-experts", "64",
                "--wikitext", str(wikitext_dir), *TINY)   # the shipped fixture: a clone has no ../shared
    assert proc.returncode == 0, proc.stderr[-3000:]

    md = (out / "table6.md").read_text()
    assert proc.stdout == md
    header = "| w_importance | w_load | Valid PPL | CV(Importance) | CV(Load) | max(Load)/mean(Load) |"
    assert header in md
    assert "3 steps" in md and "64 experts" in md and "k=4" in md   # caption: size, steps, defaults
    rows = re.findall(rf"^\| {NUM} \| {NUM} \| {NUM} \| {NUM} \| {NUM} \| {NUM} \|$", md, flags=re.M)
    assert len(rows) == 2
    assert [(float(r[0]), float(r[1])) for r in rows] == [(0.0, 0.0), (0.1, 0.1)]

    table = json.loads((out / "table6.json").read_text())
    assert [r["row"] for r in table["rows"]] == [0, 3]
    keys = {"valid_ppl": "valid_ppl", "cv_importance": "cv_importance", "cv_load": "cv_router_load",
            "max_over_mean_load": "max_over_mean_router_load"}   # the paper's Load: the smooth estimator
    for md_row, js in zip(rows, table["rows"]):
        summary = json.loads((Path(js["run_dir"]) / "summary.json").read_text())
        assert (js["w_importance"], js["w_load"]) == (float(md_row[0]), float(md_row[1]))
        for key, cell, digits in zip(keys, md_row[2:], (1, 2, 2, 2)):
            assert js[key] == summary[keys[key]] and js[key] > 0
            assert cell == f"{js[key]:.{digits}f}"
        assert summary["steps"] == 3
    assert table["tokens"] == 3 * 8 * 8

    # --reuse: nothing is retrained, the same table comes back
    again = _run("--out", str(out), "--only", "0,3", "--max-steps", "3", "--num-experts", "64", "--reuse",
                 "--wikitext", str(wikitext_dir), *TINY, timeout=30)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout == md and again.stderr.count("reusing") == 2


@pytest.mark.parametrize("flags", [["--num-experts", "32"], ["--only", "0,9"], ["--max-steps", "0"],
                                   ["--extra", "--w-load", "0.5"], ["--bogus"]])
def test_table6_bad_flag_exits_2_with_one_line(tmp_path, flags):
    proc = _run("--out", str(tmp_path / "x"), *flags, timeout=30)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0]
    assert not (tmp_path / "x").exists()
