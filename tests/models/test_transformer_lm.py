"""The transformer LM: causality of every attention variant; MAE with BCD trained, then pruned, through the CLI."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from moe_scale.config import RunConfig
from moe_scale.data import Vocab
from moe_scale.models.build import build_model
from moe_scale.models.transformer_lm import TransformerLM
from tests.cli_runs import run_cli, run_train, step_log

V, T = 30, 10


@pytest.mark.parametrize("attention", ["mha", "moa", "mae", "llama"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_no_variant_lets_position_t_see_t_plus_1(attention, training):
    llama = dict(block="llama", moa_renormalize="full") if attention == "llama" else {}
    config = RunConfig.from_settings(model="transformer", attention="mha" if llama else attention, d_model=16,
                                     num_heads=4, moa_num_experts=4, moa_top_k=2, ffn="moe", num_experts=4, top_k=2,
                                     gate="softmax_topk", dropout=0.0, num_layers=2, **llama)
    torch.manual_seed(0)
    model = TransformerLM(config, V).train(training)
    hidden = []
    model.final_norm.register_forward_hook(lambda m, i, o: hidden.append(o.detach()))
    inputs = torch.randint(0, V, (3, T))
    for t in (0, 4, T - 2):
        perturbed = inputs.clone()
        perturbed[:, t + 1:] = (perturbed[:, t + 1:] + 7) % V
        hidden.clear()
        for batch in (inputs, perturbed):
            torch.manual_seed(1)        # same MAE samples in training mode
            copy.deepcopy(model)(batch, batch)   # a copy: BatchNorm's running statistics move in training
        torch.testing.assert_close(hidden[0][:, : t + 1], hidden[1][:, : t + 1], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(hidden[0][:, t + 1:], hidden[1][:, t + 1:])


TINY_TRANSFORMER = ["--model", "transformer", "--d-model", "32", "--num-heads", "4", "--num-layers", "2",
                    "--ffn-hidden", "64", "--seq-len", "16", "--batch-size", "8", "--log-interval", "5",
                    "--eval-max-batches", "4", "--max-steps", "10", "--eval-interval", "10",
                    "--checkpoint-interval", "10", "--vocab-size", "500"]


def test_mae_bcd_train_and_prune_heads_through_the_cli(tmp_path, embedded_cache):
    run = tmp_path / "mae"
    run_train([*TINY_TRANSFORMER, "--attention", "mae", "--mae-g-unit", "step", "--mae-g-every", "2",
               "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
    log = step_log(run)
    assert len(log) == 10 and log[-1]["loss"] < log[0]["loss"]          # it trained
    summary = json.loads((run / "summary.json").read_text())
    assert math.isfinite(summary["valid_ppl"]) and summary["tokens_per_s"] > 0
    # the G steps moved the gate: compare the checkpoint with the initial model (same seed as the trainer)
    config = RunConfig.load(run / "config.json")
    torch.manual_seed(config.train.seed)
    initial = build_model(config, len(Vocab.load(run / "vocab")), seed=config.train.seed).state_dict()
    trained = torch.load(next((run / "checkpoints").glob("step*/mp_rank_00_model_states.pt")),
                         weights_only=False)["module"]
    assert not torch.equal(trained["blocks.0.attn.gate.out.weight"], initial["blocks.0.attn.gate.out.weight"])
    assert not torch.equal(trained["blocks.0.attn.mha.q_proj.weight"], initial["blocks.0.attn.mha.q_proj.weight"])

    proc = run_cli("prune-heads", "--run", str(run), "--steps", "4", "--fraction-per-step", "0.25", "--max-batches",
                   "3", cwd=tmp_path, cache=embedded_cache, check=True)
    report = json.loads((run / "pruning" / "pruning.json").read_text())
    assert [r["heads_left"] for r in report["steps"]] == [8, 6, 4, 2]
    params = [r["params"] for r in report["steps"]]
    assert params == sorted(params, reverse=True) and params[0] - params[1] == 2 * (4 * 32 * 8 + 3 * 8)
    assert all(r["speedup"] > 0 for r in report["steps"])
    assert (run / "pruning" / "pruning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "heads left" in proc.stdout


def test_positions_are_made_once_and_sliced_as_the_table_of_each_length():
    from moe_scale.models.transformer_lm import sinusoidal_positions

    config = RunConfig.from_settings(model="transformer", d_model=16, num_heads=4, num_layers=1, dropout=0.0)
    model = TransformerLM(config, V)
    like = torch.zeros(1)
    long = model.positions(12, like)
    assert torch.equal(model.positions(5, like), sinusoidal_positions(5, 16)) and model.positions(5, like) \
        .data_ptr() == long.data_ptr()   # a slice of the table already made
    assert torch.equal(model.positions(20, like), sinusoidal_positions(20, 16))   # longer: made again
    half = model.positions(7, like.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16 and torch.equal(half, sinusoidal_positions(7, 16).to(torch.bfloat16))
