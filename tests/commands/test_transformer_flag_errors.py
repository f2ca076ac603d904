"""Bad transformer / attention / pruning settings: one clear line, exit 2, nothing written."""

from __future__ import annotations

import pytest

from tests.cli_runs import assert_one_line_error, run_cli

FAST = ["--max-steps", "1", "--batch-size", "4", "--seq-len", "8", "--model", "transformer"]


@pytest.mark.parametrize("flags, fragments", [
    (["--attention", "moa", "--moa-num-experts", "4", "--moa-top-k", "5"], ["--moa-top-k 5", "--moa-num-experts 4"]),
    (["--attention", "mha", "--d-model", "30", "--num-heads", "4"], ["--num-heads 4", "--d-model 30"]),
    (["--attention", "moa", "--moa-num-experts", "3", "--ep-size", "2"], ["--moa-num-experts 3", "--ep-size 2"]),
    (["--attention", "mae", "--num-heads", "1"], ["--num-heads >= 2"]),
], ids=["k>experts", "heads-width", "moa-ep", "mae-one-head"])
def test_bad_transformer_settings(tmp_path, flags, fragments):
    out = tmp_path / "run"
    proc = run_cli("train", *FAST, *flags, "--out", str(out), cwd=tmp_path)
    assert_one_line_error(proc, *fragments)
    assert not out.exists()


@pytest.mark.parametrize("flags, fragment", [
    (["--fraction-per-step", "1.5"], "(0, 1)"),
    (["--steps", "12", "--fraction-per-step", "0.1"], "[0, 1)"),
])
def test_bad_pruning_fraction(tmp_path, flags, fragment):
    proc = run_cli("prune-heads", "--run", str(tmp_path), *flags, cwd=tmp_path)
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "pruning").exists()


def test_prune_heads_needs_a_trained_run(tmp_path):
    proc = run_cli("prune-heads", "--run", str(tmp_path / "none"), cwd=tmp_path)
    assert_one_line_error(proc, "--run", "no trained run")
