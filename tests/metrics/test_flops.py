"""The analytic counts against torch's FlopCounterMode, by-hand cases, and the TFLOPS/MFU arithmetic."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moe_scale.config import RunConfig
from moe_scale.accounting.flops import (MoATransformer, SoftmaxCost, lstm_lm_accounting, mha_layer_macs,
                                     moa_layer_macs, moa_layer_params, tflops_per_device)
from moe_scale.metrics.perf import efficiency, table_peak_gbs, table_peak_tflops
from moe_scale.models.lstm_lm import LSTMMoELM
from moe_scale.moe.cpu_backend import kernels as cpu_kernels


@pytest.fixture(autouse=True)
def torch_expert_kernels(monkeypatch):
    """FlopCounterMode does not see the native kernels (they are not torch ops); the analytic count is of the
    real rows, so the experts run on torch's grouped GEMM."""
    monkeypatch.setattr(cpu_kernels, "available", lambda like: False)

B, T, V = 4, 8, 97


def _counted_training_flops(config: RunConfig) -> int:
    torch.manual_seed(0)
    model = LSTMMoELM(config, V)
    inputs, targets = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    # oneDNN's fused LSTM is invisible to FlopCounterMode; without it the LSTM runs as counted matmuls
    with torch.backends.mkldnn.flags(enabled=False), FlopCounterMode(display=False) as counter:
        out = model(inputs, targets)
        (out.nll_sum / out.num_tokens + out.aux_loss).backward()
    return counter.get_total_flops()


def _first_step_recurrent_grad(config: RunConfig, lstms: int) -> int:
    """The one matmul the 3x rule counts that autograd skips: at t=0 the recurrent input is the constant
    zero state, so no gradient flows into it (2 FLOPs x B rows x 4h x r per LSTM)."""
    units = config.model.lstm.hidden or config.model.d_model
    recurrent = config.model.d_model if units != config.model.d_model else units
    return lstms * 2 * B * 4 * units * recurrent


@pytest.mark.parametrize("config,lstms", [
    (RunConfig.from_settings(d_model=32, expert_hidden=48, num_experts=8, top_k=2, dropout=0.0), 2),
    (RunConfig.from_settings(d_model=32, expert_hidden=48, num_experts=8, top_k=3, dropout=0.0, lstm_hidden=64), 2),
    (RunConfig.from_settings(d_model=32, layout="4xlstm", dropout=0.0), 4),
    (RunConfig.from_settings(d_model=32, expert_hidden=40, layout="lstm-ffn-lstm", ffn_layers=3, dropout=0.0), 2),
], ids=["flat", "projected-lstm", "4xlstm", "deep-ffn"])
def test_analytic_training_flops_match_flop_counter(config, lstms):
    analytic = lstm_lm_accounting(config, V, SoftmaxCost("full")).training_flops_per_token * B * T
    counted = _counted_training_flops(config)
    assert counted == pytest.approx(analytic, rel=0.05)
    # and exactly, once the known systematic difference is taken out
    assert counted == analytic - _first_step_recurrent_grad(config, lstms)


def test_hierarchical_against_flop_counter():
    """The paper's rule counts the secondary gates of the k_p chosen groups only, and so does moe_scale's router
    (one grouped GEMM over the picked groups' rows): the counter sees exactly the analytic count."""
    config = RunConfig.from_settings(d_model=32, expert_hidden=48, gate="hierarchical", num_experts=32, num_groups=4,
                                     top_k=2, top_k_secondary=2, dropout=0.0)
    analytic = lstm_lm_accounting(config, V, SoftmaxCost("full")).training_flops_per_token * B * T
    counted = _counted_training_flops(config)
    assert counted == analytic - _first_step_recurrent_grad(config, 2)
    assert counted == pytest.approx(analytic, rel=0.05)


def test_hierarchical_ops_count_only_the_chosen_groups_secondary_gates():
    config = RunConfig.from_settings(d_model=16, gate="hierarchical", num_experts=32, num_groups=4, top_k=2,
                         top_k_secondary=2, expert_hidden=8)
    counts = lstm_lm_accounting(config, V)
    assert counts.forward_macs["gating"] == 2 * 16 * 4 + 2 * 2 * 16 * 8
    assert counts.forward_macs["experts"] == 4 * 2 * 16 * 8
    assert counts.params["gating"] == 2 * 16 * 4 + 4 * 2 * 16 * 8


def test_softmax_kinds():
    config = RunConfig.from_settings(d_model=16, num_experts=4, expert_hidden=8)
    full = lstm_lm_accounting(config, 1000, SoftmaxCost("full"))
    sampled = lstm_lm_accounting(config, 1000, SoftmaxCost("sampled", 63))
    assert full.softmax_macs == 16 * 1000 and sampled.softmax_macs == 16 * 64
    assert full.ops_per_timestep == sampled.ops_per_timestep     # ops/timestep excludes the softmax
    assert full.training_flops_per_token - sampled.training_flops_per_token == 6 * 16 * (1000 - 64)


def test_moa_equations_by_hand():
    assert moa_layer_macs(10, 8, 128, 512) == 8 * 100 * 128 + 2 * 9 * 10 * 128 * 512
    assert mha_layer_macs(10, 512) == 100 * 512 + 4 * 10 * 512 ** 2       # 10.54M, the spec's C_MHA
    assert moa_layer_params(8, 128, 512) == 18 * 128 * 512
    assert MoATransformer(8, 8, 128).params() == 65_000_000            # the base the rest is derived from
    assert MoATransformer(8, 8, 256).macs() == MoATransformer(8, 32, 256).macs()   # MACs do not depend on E


def test_tflops_and_mfu_arithmetic():
    assert tflops_per_device(6e12, 2.0, 3) == pytest.approx(1.0)
    assert efficiency(1.0, 4.0, 0.5, 2.0) == {"mfu": 0.25, "all_to_all_share": 0.25}
    assert table_peak_tflops("Tesla K40m", False) == 4.29
    assert table_peak_tflops("NVIDIA H100 PCIe", True) < table_peak_tflops("NVIDIA H100 80GB HBM3", True)
    assert table_peak_tflops("Some CPU", True) is None
    assert table_peak_gbs("NVIDIA H100 80GB HBM3") == 3350.0 and table_peak_gbs("NVIDIA H100 PCIe") == 2000.0
    assert table_peak_gbs("NVIDIA H200") == 4800.0 and table_peak_gbs("Some CPU") is None


def test_paper_tflops_consistency_moe_4096_h():
    """The spec's derived check: 6·(8.9M + 512·8192)·300k words / ((15 h / 27000 steps)·16 GPUs) ≈ 0.74."""
    config = RunConfig.from_settings(d_model=512, expert_hidden=1024, gate="hierarchical", num_experts=4096,
                                     num_groups=16, top_k=2, top_k_secondary=2)
    flops_per_token = lstm_lm_accounting(config, 793_471, SoftmaxCost("sampled", 8192)).training_flops_per_token
    step_seconds = 15 * 3600 / 27000
    assert tflops_per_device(flops_per_token * 300_000, step_seconds, 16) == pytest.approx(0.74, abs=0.01)


def test_float32_mfu_reads_the_tf32_peak_where_matmuls_run_as_tf32(monkeypatch):
    """train sets float32_matmul_precision("high") on CUDA: an A100's float32 matmuls then run on TF32 tensor cores
    (156 TFLOPS), and an MFU against the 19.5 of its SIMT units would read 8x too high. GPUs without TF32 keep
    their fp32 peak; the source names the precision."""
    import torch

    from moe_scale.metrics import perf

    assert table_peak_tflops("NVIDIA A100-SXM4-80GB", False, tf32=True) == 156.0
    assert table_peak_tflops("NVIDIA A100-SXM4-80GB", False, tf32=False) == 19.5
    assert table_peak_tflops("NVIDIA H100 80GB HBM3", False, tf32=True) == 494.7
    assert table_peak_tflops("Tesla V100-SXM2-32GB", False, tf32=True) == 15.7
    assert table_peak_tflops("NVIDIA A100-SXM4-80GB", True, tf32=True) == 312.0
    monkeypatch.setattr(perf, "device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    gpu = torch.device("cuda", 0)
    for precision, expected in (("high", (156.0, "tf32")), ("highest", (19.5, "fp32"))):
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: precision)
        peak, source = perf.device_peak_tflops(gpu, half_precision=False)
        assert (peak, source) == (expected[0], f"table: NVIDIA A100-SXM4-80GB, {expected[1]}")
