"""The step's floors and the small-product curve by hand (accounting/kernels.py): the launches of a tiny LSTM-MoE
and a transformer, the recurrence's sequential timesteps, the curve at a few widths, and the compute they make."""

from __future__ import annotations

import dataclasses

import pytest

from moe_scale.accounting.gpus import get_gpu
from moe_scale.accounting.kernels import gemm_efficiency, launches, recurrent_steps_per_timestep, saturation_width
from moe_scale.accounting.layout import Layout
from moe_scale.accounting.model_shape import planned_model
from moe_scale.accounting.plan import Planner
from moe_scale.config import RunConfig
from moe_scale.layout.ds_config import DEFAULT_DS_CONFIG

H100 = get_gpu("h100-sxm")
# s_full = efficiency x value bytes x peak / (2 x memory bandwidth x 0.8): bf16 and TF32 alike on an H100 SXM
H100_FULL = 0.35 * 2 * 989.4e12 / (2 * 3350e9 * 0.8)
# The LSTM: d 64 (64 units), 32 timesteps, 16 experts of 256, top-2, 2,000 words, 32 sequences a step.
TINY = dict(num_experts=16, d_model=64, expert_hidden=256, top_k=2, vocab_size=2000, seq_len=32, batch_size=32)


def tiny(**changes) -> RunConfig:
    config = RunConfig.from_settings(**{**TINY, **changes})
    config.validate()
    return config


def test_the_small_product_curve_at_a_few_widths():
    assert saturation_width(H100, "bf16", 0.35) == pytest.approx(H100_FULL)                 # 129.2
    assert saturation_width(H100, "fp32", 0.35) == pytest.approx(0.35 * 4 * 494.7e12 / (2 * 3350e9 * 0.8))
    assert saturation_width(get_gpu("k40"), "fp32", 0.6) == pytest.approx(0.6 * 4 * 4.29e12 / (2 * 288e9 * 0.8))
    for width, share in [(2, 0.35 * 2 / H100_FULL), (16, 0.35 * 16 / H100_FULL), (64, 0.35 * 64 / H100_FULL),
                         (129, 0.35 * 129 / H100_FULL), (130, 0.35), (1024, 0.35), (8192, 0.35)]:
        assert gemm_efficiency(width, 0.35, H100_FULL) == pytest.approx(share)
    assert gemm_efficiency(64, 0.35, H100_FULL) == pytest.approx(0.1734, abs=1e-4)   # d 64: half of 35%, not 35%
    assert saturation_width(dataclasses.replace(H100, small_gemm=False), "bf16", 0.35) == 0
    assert gemm_efficiency(2, 0.35, 0.0) == 0.35


def test_the_launch_and_timestep_floors_of_a_tiny_lstm_by_hand():
    """16 H100s, ep 16: per micro-batch 30 (embedding, softmax, loss) + 2 LSTMs x 16 + the MoE layer's 133 + its
    exchange's 35 + the split vocabulary's 81 = 311 operations; 2 LSTMs x 32 timesteps x (1 + 1: 64 units, torch's
    persistent kernel both ways) = 128 sequential timesteps; 63 + 3 per step. The compute is the floor, 439 x 5 µs,
    the optimizer part its 66 x 5 µs."""
    model = planned_model(tiny())
    layout = Layout(2, 8, ep_size=16)
    assert launches(model, layout) == {"operations": 311, "recurrence": 128, "per_step": 66}
    result = Planner(model, H100, DEFAULT_DS_CONFIG).plan(layout)
    t = result["time"]
    assert t["launch_floor_s"] == pytest.approx(439 * 5e-6)
    assert t["seconds"]["compute"] == pytest.approx(2.195e-3) and t["compute_bound"] == "launches"
    assert t["seconds"]["optimizer"] == pytest.approx(66 * 5e-6)
    assert result["warnings"] and result["warnings"][0].startswith("the compute is the launch floor")
    assert "311 kernel launches and 128 sequential LSTM timesteps a step x 5 µs = 2.195 ms" in result["warnings"][0]
    # one GPU: no exchange, no split tables, one rank; two micro-batches: twice the operations and timesteps
    assert launches(model, Layout(1, 1)) == {"operations": 195, "recurrence": 128, "per_step": 63}
    accumulated = planned_model(tiny(grad_accum=2))
    assert launches(accumulated, Layout(1, 1)) == {"operations": 390, "recurrence": 256, "per_step": 63}


@pytest.mark.parametrize("changes,per_timestep", [
    ({}, 2),                                          # 64 units: persistent forward and backward
    ({"d_model": 160}, 3),                            # persistent forward (<= 192), standard backward (> 128)
    ({"d_model": 256}, 4),                            # standard: the recurrent product and the element-wise kernel
    ({"lstm_hidden": 128}, 6),                        # projected back to d: standard, + the projection each way
])
def test_the_recurrence_per_timestep(changes, per_timestep):
    assert recurrent_steps_per_timestep(tiny(**changes)) == per_timestep


def test_transformer_launches_per_block():
    moe = planned_model(RunConfig.from_settings(model="transformer", ffn="moe", num_layers=3, num_experts=8,
                                                d_model=64, num_heads=4, vocab_size=500))
    dense = planned_model(RunConfig.from_settings(model="transformer", num_layers=3, d_model=64, num_heads=4,
                                                  vocab_size=500))
    assert launches(moe, Layout(1, 1)) == {"operations": 36 + 3 * 174, "recurrence": 0, "per_step": 63}
    assert launches(dense, Layout(1, 1)) == {"operations": 36 + 3 * 65, "recurrence": 0, "per_step": 44}
    assert launches(moe, Layout(1, 8, ep_size=8))["operations"] == 36 + 3 * 174 + 3 * 35 + 81


def test_the_compute_of_narrow_products_by_hand():
    """The tiny LSTM on 16 H100s in fp32 (TF32), 64 tokens and 2 sequences per GPU, 128 rows per expert: each
    product at 0.35 x min(1, its smallest dimension / 129.2) of 494.7 TFLOPS; a FLOP-bound step (no launch floor)
    prints the curve's warning."""
    model = planned_model(tiny())
    tokens = 64
    parts = [(2 * 4 * 64 * 64, 64),        # the LSTMs' input products: 64 tokens x d 64 -> 256
             (2 * 4 * 64 * 64, 2),         # their recurrent products: 2 sequences per timestep
             (2 * 64 * 16, 16),            # the gate: W_g and W_noise, d -> 16 experts
             (2 * 2 * 64 * 256, 64),       # 2 active experts of 64 -> 256 -> 64, 64 x 16 x 2 / 16 = 128 rows each
             (64 * 2000, 64)]              # the softmax: d 64 -> 2,000 words
    assert sum(macs for macs, _ in parts) * 6 == model.flops_per_token
    by_hand = sum(6 * macs * tokens / (494.7e12 * 0.35 * min(1, width / H100_FULL)) for macs, width in parts)
    gpu = dataclasses.replace(H100, launch_s=0.0)
    t = Planner(model, gpu, DEFAULT_DS_CONFIG).plan(Layout(2, 8, ep_size=16))["time"]
    assert t["flops_s"] == pytest.approx(by_hand) and t["seconds"]["compute"] == pytest.approx(by_hand)
    assert t["gemm_efficiency"] == pytest.approx(model.flops_per_token * tokens / (by_hand * 494.7e12))
    assert t["narrow_products"] == {"lstm input": 64, "lstm recurrent": 2, "gate": 16, "experts": 64, "softmax": 64}
    result = Planner(model, gpu, DEFAULT_DS_CONFIG).plan(Layout(2, 8, ep_size=16))
    assert result["warnings"][0].startswith(f"the FLOPs run at {t['gemm_efficiency']:.1%} of the peak, not 35%")
    # wide enough but for the gate's 16 columns: within 10% of the stated efficiency, no warning (without the
    # launch floor, which a 256-wide LSTM of 256 timesteps a step still meets on 16,384 tokens per GPU)
    wide = planned_model(tiny(d_model=256, expert_hidden=512, batch_size=4096, vocab_size=4000))
    wide_result = Planner(wide, gpu, DEFAULT_DS_CONFIG).plan(Layout(1, 8, ep_size=8))
    assert wide_result["time"]["narrow_products"] == {"gate": 16}
    assert 0.9 * 0.35 < wide_result["time"]["gemm_efficiency"] < 0.35 and not wide_result["warnings"]
