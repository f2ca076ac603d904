"""MoA with expert parallelism: 2 processes (deepspeed launcher, gloo, ep_size 2, attention experts and MoE FFN
experts split over the ranks, K/V all-gathered) take the same steps as 1 process on the same global batch."""

from __future__ import annotations

import json

import pytest

from tests.cli_runs import run_eval, run_train, step_log
from tests.paths import DS_CONFIGS

MOA = ["--model", "transformer", "--attention", "moa", "--ffn", "moe", "--gate", "softmax_topk",
       "--d-model", "32", "--num-layers", "2", "--moa-num-experts", "4", "--moa-top-k", "2", "--head-dim", "8",
       "--num-experts", "4", "--top-k", "2", "--expert-hidden", "32", "--seq-len", "16", "--batch-size", "8",
       "--vocab-size", "500", "--log-interval", "2", "--eval-max-batches", "4", "--dropout", "0", "--lr", "0.01",
       "--warmup-steps", "0", "--max-steps", "4", "--eval-interval", "4", "--checkpoint-interval", "4"]


# Size: 4 steps (the loss must fall and every step match) of a 2-block MoA transformer on 1 and 2 ranks.
@pytest.mark.multiprocess
def test_moa_two_processes_expert_parallel_equal_one_process(tmp_path, embedded_cache):
    ds = str(DS_CONFIGS / "zero2_ep.json")
    one, two = tmp_path / "one", tmp_path / "two"
    run_train([*MOA, "--ds-config", ds, "--out", str(one)], cwd=tmp_path, cache=embedded_cache)
    run_train([*MOA, "--ds-config", ds, "--ep-size", "2", "--out", str(two)], cwd=tmp_path, cache=embedded_cache,
              nprocs=2)
    single, double = step_log(one), step_log(two)
    assert len(single) == 4
    for a, b in zip(single, double, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5), (a, b)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-4, abs=1e-6), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)
    assert single[-1]["loss"] < single[0]["loss"]
    first, second = (json.loads((run / "summary.json").read_text()) for run in (one, two))
    assert second["valid_ppl"] == pytest.approx(first["valid_ppl"], rel=1e-4)
    assert second["layer0_cv_load"] == pytest.approx(first["layer0_cv_load"], rel=1e-3, abs=1e-6)   # MoA layer 0
    # one checkpoint file per global attention expert: the 2-rank run evaluates in one process like the 1-rank one
    assert run_eval(["--run", str(two)], cwd=tmp_path, cache=embedded_cache)["ppl"] == pytest.approx(
        run_eval(["--run", str(one)], cwd=tmp_path, cache=embedded_cache)["ppl"], rel=1e-4)
