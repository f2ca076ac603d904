"""--optimizer factored (Shazeer et al. App. D) against a reference loop, step by step; memory; config checks."""

from __future__ import annotations

import math
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
from transformers.optimization import Adafactor

from moe_scale.config import TrainConfig
from moe_scale.errors import UserError
from moe_scale.layout.checks import check_optimizer_fits
from moe_scale.train.factored_optimizer import FactoredExpertAdam, build_optimizer, optimizer_state_numel
from tests.paths import DS_CONFIGS

BETA2, EPS, LR = 0.999, 1e-8, 0.01


def _reference_factored_steps(w0: list, grads: list, wd: float) -> list:
    """Plain-Python App. D: per matrix, running averages of row means and column means of g^2 (bias-corrected),
    second moment = outer product / mean of the row averages, no first moment; decoupled weight decay."""
    E, R, C = len(w0), len(w0[0]), len(w0[0][0])
    w = [[list(row) for row in m] for m in w0]
    rows = [[0.0] * R for _ in range(E)]
    cols = [[0.0] * C for _ in range(E)]
    for t, g in enumerate(grads, start=1):
        for e in range(E):
            for i in range(R):
                rows[e][i] = BETA2 * rows[e][i] + (1 - BETA2) * sum(g[e][i][j] ** 2 for j in range(C)) / C
            for j in range(C):
                cols[e][j] = BETA2 * cols[e][j] + (1 - BETA2) * sum(g[e][i][j] ** 2 for i in range(R)) / R
            correction = 1 - BETA2 ** t
            r_hat = [r / correction for r in rows[e]]
            c_hat = [c / correction for c in cols[e]]
            mean_r = sum(r_hat) / R
            for i in range(R):
                for j in range(C):
                    v = r_hat[i] * c_hat[j] / mean_r
                    w[e][i][j] = w[e][i][j] * (1 - LR * wd) - LR * g[e][i][j] / (math.sqrt(v) + EPS)
    return w


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_factored_step_by_step_equals_the_reference_loop(wd):
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(2, 3, 4, generator=gen, dtype=torch.float64))
    grads = [torch.randn(2, 3, 4, generator=gen, dtype=torch.float64) * (1 + s) for s in range(5)]
    optimizer = FactoredExpertAdam([{"params": [w], "factored": True}], lr=LR, betas=(0.9, BETA2), eps=EPS,
                                   weight_decay=wd)
    w0 = w.detach().tolist()
    for step, g in enumerate(grads, start=1):
        w.grad = g.clone()
        optimizer.step()
        expected = torch.tensor(_reference_factored_steps(w0, [x.tolist() for x in grads[:step]], wd),
                                dtype=torch.float64)
        torch.testing.assert_close(w.detach(), expected, rtol=1e-12, atol=1e-12)
    assert set(optimizer.state[w]) == {"step", "row", "col"}   # no first moment, no full second moment


def test_factored_estimate_matches_transformers_adafactor_factorisation():
    """The second-moment estimate from our row/column state equals the one transformers' Adafactor builds
    from the same state (its `_approx_sq_grad` returns 1/sqrt(v))."""
    gen = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(3, 5, 7, generator=gen))
    optimizer = FactoredExpertAdam([{"params": [w], "factored": True}], lr=LR, betas=(0.9, BETA2), eps=0.0)
    w.grad = torch.randn(3, 5, 7, generator=gen)
    before = w.detach().clone()
    optimizer.step()
    state = optimizer.state[w]
    inv_sqrt_v = Adafactor._approx_sq_grad(state["row"] / (1 - BETA2), state["col"] / (1 - BETA2))
    torch.testing.assert_close(w.detach(), before - LR * w.grad * inv_sqrt_v, rtol=1e-5, atol=1e-6)


def test_dense_groups_are_exactly_adamw():
    gen = torch.Generator().manual_seed(2)
    a = torch.nn.Parameter(torch.randn(4, 6, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    ours = FactoredExpertAdam([{"params": [a]}], lr=LR, weight_decay=0.01)
    reference = torch.optim.AdamW([b], lr=LR, weight_decay=0.01)
    for _ in range(4):
        g = torch.randn(4, 6, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        reference.step()
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_build_optimizer_factors_only_expert_groups_and_cuts_their_state_over_100x():
    """Paper-size expert matrices (d=512, h=1024; 4 experts stacked): Adam holds 2*d*h numbers per matrix,
    the factored optimizer d+h (d+h = 1536 vs 1,048,576: 683x)."""
    experts = torch.nn.Parameter(torch.zeros(4, 512, 1024))
    dense = torch.nn.Parameter(torch.zeros(512))
    groups = lambda: [{"params": [dense], "name": "dense"}, {"params": [experts], "name": "ep", "moe": True}]
    adam = build_optimizer(groups(), TrainConfig(optimizer="adam"))
    factored = build_optimizer(groups(), TrainConfig(optimizer="factored"))
    assert isinstance(adam, torch.optim.AdamW) and isinstance(factored, FactoredExpertAdam)
    for optimizer in (adam, factored):
        experts.grad, dense.grad = torch.ones_like(experts), torch.ones_like(dense)
        optimizer.step()
    assert [g["factored"] for g in factored.param_groups] == [False, True]
    assert optimizer_state_numel(factored, factored_only=True) == 4 * (512 + 1024)
    assert optimizer_state_numel(factored, factored_only=False) == 2 * 512   # dense: Adam's m and v
    ratio = (optimizer_state_numel(adam) - 2 * 512) / optimizer_state_numel(factored, factored_only=True)
    assert ratio >= 100


def test_factored_refuses_zero_and_half_precision_configs():
    train = TrainConfig(optimizer="factored")
    check_optimizer_fits(train, {"zero_optimization": {"stage": 0}}, "--ds-config x.json")
    for bad, what in (({"zero_optimization": {"stage": 2}}, "ZeRO stage 2"),
                      ({"bf16": {"enabled": True}}, "bf16 enabled")):
        with pytest.raises(UserError, match=what):
            check_optimizer_fits(train, bad, "--ds-config x.json")
    check_optimizer_fits(TrainConfig(optimizer="adam"), {"zero_optimization": {"stage": 2}}, "x")


def test_factored_optimizer_adaptive_softmax_and_recompute_train_and_evaluate(tmp_path, embedded_cache):
    from tests.cli_runs import TINY, run_eval, run_train, step_log
    run = tmp_path / "run"
    run_train([*TINY, "--optimizer", "factored", "--softmax", "adaptive", "--adaptive-cutoffs", "100,1000",
               "--expert-recompute", "--max-steps", "6", "--eval-interval", "6", "--eval-max-batches", "0",
               "--lr", "0.01", "--warmup-steps", "0", "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
    losses = [r["loss"] for r in step_log(run)]
    assert losses[-1] < losses[0]
    saved = [torch.load(f, weights_only=False) for f in (run / "checkpoints" / "step00000006").glob("*.pt")]
    optimizers = [s["optimizer"] for s in saved if isinstance(s, dict) and s.get("optimizer")]
    assert optimizers, "no optimizer state in the checkpoint"
    assert [g["factored"] for g in optimizers[0]["param_groups"]] == [False, True]
    assert any({"row", "col"} <= set(v) for v in optimizers[0]["state"].values())   # the factored state is saved
    result = run_eval(["--run", str(run)], cwd=tmp_path, cache=embedded_cache)   # rebuilds the adaptive softmax
    import json
    assert result["ppl"] == pytest.approx(json.loads((run / "summary.json").read_text())["valid_ppl"], rel=1e-6)


def test_chunked_factored_step_equals_one_chunk(monkeypatch):
    """The in-place step works a chunk of experts at a time (bounded temporaries); chunking changes nothing."""
    import moe_scale.train.factored_optimizer as module
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(37, 8, 16, generator=gen, dtype=torch.float64)
    grads = [torch.randn(37, 8, 16, generator=gen, dtype=torch.float64) for _ in range(3)]
    results = []
    for chunk_elements in (1 << 22, 8 * 16 * 5):     # one chunk; chunks of 5 experts (the last one of 2)
        monkeypatch.setattr(module, "CHUNK_ELEMENTS", chunk_elements)
        w = torch.nn.Parameter(w0.clone())
        optimizer = FactoredExpertAdam([{"params": [w], "factored": True}], lr=LR)
        for g in grads:
            w.grad = g.clone()
            optimizer.step()
        results.append(w.detach())
    assert torch.equal(results[0], results[1])


def test_cli_refuses_factored_with_zero2_before_writing_anything(tmp_path):
    from tests.cli_runs import assert_one_line_error, run_cli
    config = DS_CONFIGS / "zero2_ep.json"
    proc = run_cli("train", "--optimizer", "factored", "--ds-config", str(config), "--out", str(tmp_path / "run"),
                   "--max-steps", "1", cwd=tmp_path)
    assert_one_line_error(proc, "ZeRO stage 2", "--optimizer factored")
    assert not (tmp_path / "run").exists()


def test_adam_is_torchs_fused_adamw_and_steps_as_the_reference():
    """--optimizer adam is AdamW in its fused form (one multi-threaded pass per tensor: big sparse models were
    optimizer-bound with the per-tensor loop), the same algorithm as the reference to float32 rounding."""
    gen = torch.Generator().manual_seed(4)
    a = torch.nn.Parameter(torch.randn(3, 40, 50, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    ours = build_optimizer([{"params": [a], "moe": True}], TrainConfig(optimizer="adam", lr=LR, weight_decay=0.01))
    reference = torch.optim.AdamW([b], lr=LR, weight_decay=0.01, foreach=False)
    assert ours.defaults["fused"] is True
    for _ in range(5):
        g = torch.randn(3, 40, 50, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        reference.step()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _rows_split_worker(rank: int, world: int) -> dict:
    """Rank r holds rows [4r, 4r + 4) of each of 2 matrices [8, 5] (--etp-size 2: its hidden units)."""
    import torch.distributed as dist

    from moe_scale.moe.experts.ffn import ROWS_SPLIT_OVER

    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(2, 8, 5, generator=gen, dtype=torch.float64)
    grads = [torch.randn(2, 8, 5, generator=gen, dtype=torch.float64) for _ in range(3)]
    mine = slice(4 * rank, 4 * rank + 4)
    w = torch.nn.Parameter(whole[:, mine].clone())
    setattr(w, ROWS_SPLIT_OVER, dist.group.WORLD)
    optimizer = FactoredExpertAdam([{"params": [w], "factored": True}], lr=LR, betas=(0.9, BETA2), eps=EPS)
    for g in grads:
        w.grad = g[:, mine].clone()
        optimizer.step()
    return {"w": w.detach(), "whole": whole, "grads": grads, "col": optimizer.state[w]["col"]}


@pytest.mark.multiprocess
def test_rows_split_over_ranks_step_as_the_whole_matrices():
    """--etp-size: each rank's rows step as the whole matrix's would (the reference loop's), the column averages
    whole on both."""
    from tests.multiproc import run_ranks

    results = run_ranks(_rows_split_worker, world_size=2)
    want = torch.tensor(_reference_factored_steps(results[0]["whole"].tolist(),
                                                  [g.tolist() for g in results[0]["grads"]], 0.0), dtype=torch.float64)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["w"], want[:, 4 * rank:4 * rank + 4], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(results[0]["col"], results[1]["col"], rtol=0, atol=0)


def test_a_vocabulary_tables_rows_in_the_experts_group_take_adamw():
    """(models/vocab_parallel.py: the tables split over the processes share the experts' group name)"""
    from moe_scale.models.vocab_parallel import ROW_SPLIT_TABLE

    gen = torch.Generator().manual_seed(1)
    rows, reference = (torch.nn.Parameter(torch.randn(6, 4, generator=gen)) for _ in range(2))
    with torch.no_grad():
        reference.copy_(rows)
    setattr(rows, ROW_SPLIT_TABLE, True)
    ours = FactoredExpertAdam([{"params": [rows], "factored": True}], lr=LR, weight_decay=0.01)
    adamw = torch.optim.AdamW([reference], lr=LR, weight_decay=0.01)
    for _ in range(3):
        rows.grad = torch.randn(6, 4, generator=gen)
        reference.grad = rows.grad.clone()
        ours.step()
        adamw.step()
    assert set(ours.state[rows]) == {"step", "exp_avg", "exp_avg_sq"}
    torch.testing.assert_close(rows.detach(), reference.detach())
