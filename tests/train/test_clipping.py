"""Expert-aware clipping in one process equals torch's clip_grad_norm_ (the 2-process case is in
test_multiprocess.py, against a 1-process run)."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from moe_scale.config import RunConfig
from moe_scale.models.lstm_lm import LSTMMoELM
from moe_scale.moe.deepspeed_adapter import mark_copies
from moe_scale.train.clipping import expert_aware_clip_


def model_with_grads(seed: int) -> LSTMMoELM:
    torch.manual_seed(seed)
    model = LSTMMoELM(RunConfig.from_settings(d_model=8, expert_hidden=8, num_experts=4, top_k=2), vocab_size=30,
                      seed=seed)
    x = torch.randint(0, 30, (2, 6))
    out = model(x, x)
    (out.nll_sum + out.aux_loss).backward()
    return model


def test_matches_torch_clip_grad_norm():
    ours, reference = model_with_grads(0), model_with_grads(0)
    norm = expert_aware_clip_(ours, max_norm=0.1)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
    assert abs(norm - float(expected)) < 1e-5 * float(expected)
    assert norm > 0.1
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_a_copy_of_another_ranks_parameter_is_clipped_but_not_counted():
    """(moe/deepspeed_adapter.py's mark_copies: the hierarchical gate's secondary gates on the --etp-size shards'
    ranks but the first)"""
    ours, reference = model_with_grads(0), model_with_grads(0)
    copy = ours.moe.experts.w_out
    mark_copies([copy])
    norm = expert_aware_clip_(ours, max_norm=0.1)
    counted = [p for p, q in zip(reference.parameters(), ours.parameters()) if q is not copy]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in counted]))
    assert abs(norm - float(expected)) < 1e-5 * float(expected)
    for a, b in zip(ours.parameters(), reference.parameters()):   # every gradient scaled by the same factor
        torch.testing.assert_close(a.grad, b.grad * (0.1 / (expected + 1e-6)))


def test_no_clipping_below_the_threshold():
    model = model_with_grads(1)
    before = [p.grad.clone() for p in model.parameters()]
    norm = expert_aware_clip_(model, max_norm=1e9)
    assert norm > 0
    for grad, param in zip(before, model.parameters()):
        assert torch.equal(grad, param.grad)


def test_sum_of_squares_is_float64_accurate_and_the_same_for_any_expert_split():
    """Expert-sized tensors: per-row float32 norms summed in float64, within 1e-7 of the exact float64 sum (a
    plain float32 reduction over 10^7 numbers is off by ~1e-3) and the same whatever the split over ranks;
    small tensors: the exact float64 sum."""
    from moe_scale.train.clipping import _sum_of_squares

    gen = torch.Generator().manual_seed(0)
    for shape in [(), (7,), (64, 3), (8, 64, 64), (32, 208, 128)]:
        g = torch.randn(shape, generator=gen) * 3
        exact = g.double().pow(2).sum()
        error = abs(_sum_of_squares(g) - exact) / exact
        assert error <= (1e-7 if len(shape) == 3 else 1e-15), (shape, error)
    experts = torch.randn(32, 208, 128, generator=gen)
    halves = _sum_of_squares(experts[:16]) + _sum_of_squares(experts[16:])
    torch.testing.assert_close(halves, _sum_of_squares(experts), rtol=1e-14, atol=0)
    half = torch.randn(4, 64, 64, generator=gen).bfloat16()   # half-precision gradients: rows in float32
    assert abs(_sum_of_squares(half) - half.double().pow(2).sum()) <= 1e-6 * half.double().pow(2).sum()


def _stage0_worker(rank, world, clip):
    from torch import nn

    from moe_scale.config import TrainConfig
    from moe_scale.train.engine import TrainingEngine

    config = {"zero_optimization": {"stage": 0}, "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1}
    if clip is not None:
        config["gradient_clipping"] = clip
    trainer = TrainingEngine(nn.Linear(2, 2), config, TrainConfig())
    return trainer.clip, trainer.engine.gradient_clipping()


def test_without_zero_we_clip_once_and_deepspeed_never():
    """Stage 0 in float32: moe_scale clips (the norm right under expert parallelism) at the JSON's threshold, or
    DeepSpeed's default 1.0 where it has none, and DeepSpeed's own stage-0 clipping is off (a config without the key
    would otherwise get DeepSpeed's default, 1.0, applied again with its wrong norm after ours)."""
    from tests.multiproc import run_ranks

    for clip, expected in ((5.0, 5.0), (0.0, 0.0), (None, 1.0)):
        assert run_ranks(_stage0_worker, world_size=1, args=(clip,), deepspeed=True) == [(expected, 0.0)], clip
