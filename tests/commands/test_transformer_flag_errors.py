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
    (["--block", "llama", "--attention", "moa"], ["--block llama", "--attention mha"]),
    (["--block", "llama", "--d-model", "12", "--num-heads", "4"], ["head width 3 must be even"]),
    (["--block", "llama", "--softmax", "adaptive", "--adaptive-cutoffs", "100"], ["--softmax full or sampled"]),
    (["--block", "llama", "--ffn", "moe", "--gate", "noisy_topk"], ["routes as Mixtral", "--gate softmax_topk "
                                                                    "--moa-renormalize full", "not --gate noisy_topk"]),
    (["--block", "llama", "--ffn", "moe", "--moa-renormalize", "detached"], ["--moa-renormalize detached"]),
    (["--block", "llama", "--ffn", "moe", "--dispatch", "capacity"], ["--dispatch dropless"]),
    (["--block", "llama", "--rope-theta", "1"], ["--rope-theta must be larger than 1"]),
    (["--tie-embeddings"], ["--tie-embeddings does nothing here", "--block llama"]),
    (["--rope-theta", "1e6"], ["--rope-theta does nothing here", "--block llama"]),
    (["--init-from-hf", "x"], ["--init-from-hf does nothing here", "--block llama"]),
    (["--block", "llama", "--init-from-hf", "nowhere"], ["--init-from-hf nowhere: no such directory"]),
    (["--qk-norm"], ["--qk-norm does nothing here", "--block llama"]),
    (["--block", "llama", "--rms-norm-eps", "0"], ["--rms-norm-eps 0 must lie between 0 and 1"]),
    (["--block", "llama", "--ffn", "moe", "--rank-capacity-factor", "0.5"], ["--rank-capacity-factor 0.5 must be 0"]),
    (["--ffn", "moe", "--dispatch", "capacity", "--rank-capacity-factor", "2"],
     ["--rank-capacity-factor does nothing here", "--dispatch dropless"]),
    (["--ffn", "dense", "--record-routes", "r"], ["--record-routes does nothing here", "routed layers"]),
    (["--ffn", "moe", "--gate", "softmax_topk", "--record-routes", "r", "--replay-routes", "r"],
     ["name the same directory"]),
], ids=["k>experts", "heads-width", "moa-ep", "mae-one-head", "llama-moa", "llama-odd-head", "llama-adaptive",
        "llama-gate", "llama-detached", "llama-capacity", "llama-theta", "tie-default-block", "theta-default-block",
        "init-from-hf-default-block", "init-from-hf-missing", "qk-norm-default-block", "rms-norm-eps",
        "rank-capacity-small", "rank-capacity-capacity-mode", "record-routes-dense", "record-and-replay-same"])
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
