"""tools/count_step_syncs.py: a regular training step's host reads and kernel launches as JSON lines, and its flags
(the counts themselves are held by tests/tools/test_step_syncs.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli_runs import cli_env
from tests.paths import TOOLS

TOOL = TOOLS / "count_step_syncs.py"
SMALL = ["--layers", "2", "--experts", "8", "--d-model", "16", "--hidden", "16", "--heads", "2", "--seq-len", "8",
         "--batch-size", "4"]


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("count_step_syncs")


@pytest.mark.slow
def test_one_line_per_run_with_every_phase(tmp_path, embedded_cache):
    out = tmp_path / "steps.jsonl"
    proc = subprocess.run([sys.executable, str(TOOL), *SMALL, "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=cli_env(embedded_cache))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [json.loads(line) for line in out.read_text().splitlines()] == [row]
    assert (row["model"], row["ranks"], row["rank"], row["moe_layers"], row["experts"]) == ("transformer", 1, 0, 2, 8)
    assert row["ds_config"].endswith("gpu_bf16_zero2.json") and row["tokens_per_rank"] == 32
    assert set(row["phases"]) == {"forward", "backward", "clip", "optimizer", "loop"}
    assert row["kernel_ops"] == sum(phase["kernel_ops"] for phase in row["phases"].values()) > 0
    assert row["host_reads"] == row["all_to_all_count_reads"] == 0 and row["reads"] == []


def test_the_flags_become_the_training_runs(tool):
    args = tool.parse_args(["--model", "lstm", "--experts", "16", "--k", "4", "--ranks", "1,2"])
    flags = tool.train_flags(args, 2)
    assert "--model" not in flags and flags[flags.index("--num-experts") + 1] == "16"
    assert flags[flags.index("--top-k") + 1] == "4" and flags[flags.index("--ep-size") + 1] == "2"
    assert flags[flags.index("--ds-config") + 1].endswith("ds_configs/gpu_bf16_zero2.json")
    transformer = tool.train_flags(tool.parse_args([]), 1)
    assert transformer[transformer.index("--num-layers") + 1] == "8" and "--ffn" in transformer


@pytest.mark.parametrize("flags, fragment", [(["--ranks", "3"], "--ranks 3"), (["--model", "gru"], "--model"),
                                             (["--k", "9", "--experts", "8"], "--k 9"),
                                             (["--ds-config", "/nonexistent.json"], "--ds-config"),
                                             (["--ranks", "2", "--experts", "7"], "even"),
                                             (["--d-model", "30", "--heads", "4"], "--heads 4"),
                                             (["--out", "/nonexistent/x.jsonl"], "--out")])
def test_bad_flags_are_one_line(tool, flags, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool.parse_args(flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0]
