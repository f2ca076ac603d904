"""The aux-free gate and shared experts in `moe-scale train`: the routing biases move once per optimizer step, are
saved with the model, and a resumed run repeats an uninterrupted one exactly (biases restored)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli_runs import TINY, run_eval, run_train, step_log

pytestmark = pytest.mark.slow

RATE = 0.01
FLAGS = [*TINY, "--gate", "aux_free", "--bias-update-rate", str(RATE), "--seq-balance-weight", "0.01",
         "--shared-experts", "1", "--shared-expert-hidden", "16", "--shared-expert-gate", "--grad-accum", "2",
         "--dropout", "0.2", "--eval-interval", "100", "--eval-max-batches", "0"]


def _module(run, step: int) -> dict:
    path = run / "checkpoints" / f"step{step:08d}" / "mp_rank_00_model_states.pt"
    return torch.load(path, weights_only=False)["module"]


# Size: 6 steps with a checkpoint at 3: the fewest that split a run in two and move the biases after the split.
def test_the_biases_move_once_per_step_and_a_resume_repeats_an_uninterrupted_run(tmp_path, embedded_cache):
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = [*FLAGS, "--checkpoint-interval", "3", "--keep-checkpoints", "0"]
    run_train([*common, "--max-steps", "6", "--out", str(straight)], cwd=tmp_path, cache=embedded_cache)
    run_train([*common, "--max-steps", "3", "--out", str(split)], cwd=tmp_path, cache=embedded_cache)
    run_train([*common, "--max-steps", "6", "--out", str(split), "--resume"], cwd=tmp_path, cache=embedded_cache)

    after3, after6 = _module(straight, 3)["moe.router.score_bias"], _module(straight, 6)["moe.router.score_bias"]
    # b moves by ±u or 0 per expert and step: after 3 steps a multiple of u, at most 3u from 0, and not all 0
    steps3 = after3 / RATE
    torch.testing.assert_close(steps3, steps3.round(), rtol=0, atol=1e-4)
    assert steps3.abs().max() <= 3 + 1e-4 and torch.count_nonzero(steps3.round()) > 0
    assert ((after6 - after3) / RATE).abs().max() <= 3 + 1e-4 and not torch.equal(after3, after6)
    assert {"moe.shared.w_in", "moe.shared.w_out", "moe.shared.w_gate"} <= set(_module(straight, 3))

    expected, resumed = step_log(straight), step_log(split)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(expected, resumed):
        assert a["loss"] == b["loss"] and a["aux_loss"] == b["aux_loss"], (a, b)
    assert all(r["aux_loss"] > 0 for r in expected)            # the sequence-wise loss, the only one
    assert torch.equal(_module(split, 6)["moe.router.score_bias"], after6)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["gate"] == "aux_free" and summary["bias_spread"] > 0 and "seq_balance_loss" in summary
    # eval and a fresh process read the biases back: the same perplexity from both runs' last checkpoints
    assert run_eval(["--run", str(split)], cwd=tmp_path, cache=embedded_cache)["ppl"] == \
        pytest.approx(summary["valid_ppl"], rel=1e-6)
