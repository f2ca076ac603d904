"""--resume continues the run's own configuration: flags beside it may change only how long it trains and how
often it reports; the step log holds every step once, in order, whatever the stopped run had logged."""

from __future__ import annotations

import json

import pytest

from tests.cli_runs import TINY, run_train, step_log

SETTINGS = [*TINY, "--num-experts", "4", "--dropout", "0.1", "--lr", "0.01", "--checkpoint-interval", "3",
            "--eval-interval", "100"]


def test_resume_with_only_max_steps_trains_the_runs_own_configuration(tmp_path, embedded_cache):
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_train([*SETTINGS, "--max-steps", "6", "--out", str(straight)], cwd=tmp_path, cache=embedded_cache)
    run_train([*SETTINGS, "--max-steps", "3", "--out", str(split)], cwd=tmp_path, cache=embedded_cache)
    # no model, data or optimiser flags: they come from the run's config.json
    run_train(["--resume", "--max-steps", "6", "--log-interval", "3", "--out", str(split)], cwd=tmp_path,
              cache=embedded_cache)
    assert [(r["step"], r["loss"], r["lr"]) for r in step_log(split)] == \
        [(r["step"], r["loss"], r["lr"]) for r in step_log(straight)]
    config = json.loads((split / "config.json").read_text())
    assert config["moe"]["experts"]["num_experts"] == 4 and config["train"]["lr"] == 0.01
    assert config["train"]["max_steps"] == 6 and config["run"]["log_interval"] == 3


def test_steps_logged_after_the_last_checkpoint_are_not_repeated(tmp_path, embedded_cache):
    """A run stopped after logging steps its last checkpoint does not hold (here: the marker is moved back to
    step 3 of a 6-step run, as a kill after step 5 would leave it) resumes with each step logged once."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    run_train([*SETTINGS, "--max-steps", "6", "--out", str(straight)], cwd=tmp_path, cache=embedded_cache)
    run_train([*SETTINGS, "--max-steps", "6", "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
    (run / "checkpoints" / "complete").write_text(json.dumps({"tag": "step00000003", "step": 3}))
    run_train(["--resume", "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
    assert [r["step"] for r in step_log(run)] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in step_log(run)] == [r["loss"] for r in step_log(straight)]
    # the summary's train_ppl is over the same interval as the uninterrupted run's
    assert json.loads((run / "summary.json").read_text())["train_ppl"] == \
        json.loads((straight / "summary.json").read_text())["train_ppl"]


@pytest.mark.slow   # over 5 s on 2 cores (tests/README.md)
def test_a_llama_block_run_with_tied_embeddings_resumes_to_the_same_steps(tmp_path, embedded_cache):
    """The tied output layer (one parameter under two names) and the SwiGLU experts come back from a checkpoint
    as they were: 3 + 3 resumed steps are the 6 straight ones."""
    llama = [*SETTINGS, "--model", "transformer", "--block", "llama", "--ffn", "moe", "--num-layers", "2",
             "--tie-embeddings", "--log-interval", "1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_train([*llama, "--max-steps", "6", "--out", str(straight)], cwd=tmp_path, cache=embedded_cache)
    run_train([*llama, "--max-steps", "3", "--out", str(split)], cwd=tmp_path, cache=embedded_cache)
    run_train(["--resume", "--max-steps", "6", "--out", str(split)], cwd=tmp_path, cache=embedded_cache)
    assert [(r["step"], r["loss"], r["aux_loss"]) for r in step_log(split)] == \
        [(r["step"], r["loss"], r["aux_loss"]) for r in step_log(straight)]
