"""tools/attention_table.py: one tiny row end to end, and its flag errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_scale.accounting.attention_flops import mha_macs
from tests.paths import TOOLS

TOOL = TOOLS / "attention_table.py"


def _run(*flags: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, str(TOOL), *flags], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_one_row_end_to_end(tmp_path, wikitext_dir):
    proc = _run("--out", str(tmp_path / "t"), "--only", "mha", "--max-steps", "2", "--eval-max-batches", "2",
                "--wikitext", str(wikitext_dir), cwd=tmp_path)   # the shipped fixture: a clone has no ../shared
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "t" / "attention_table.json").read_text())
    summary = json.loads((tmp_path / "t" / "runs" / "mha" / "summary.json").read_text())
    assert rows["mha"]["valid_ppl"] == summary["valid_ppl"]
    # eq. 19 per token at T=32, d_m=64 (2 layers), the MHA's own projections with biases
    assert rows["mha"]["attention_macs_per_token"] == 2 * mha_macs(32, 64) // 32
    assert rows["mha"]["attention_params"] == 2 * (4 * 64 * 64 + 4 * 64)
    assert "| mha |" in (tmp_path / "t" / "attention_table.md").read_text()


def test_bad_flags_one_line(tmp_path):
    for flags in (["--only", "gru"], ["--max-steps", "0"], ["--wikitext", str(tmp_path)]):
        proc = _run("--out", str(tmp_path / "t"), *flags, cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "t").exists()
