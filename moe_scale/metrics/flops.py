"""Analytic FLOP counts, by Shazeer et al.'s rule (§5.1 and App. C).

Forward multiply-adds (MACs) per token, active experts only, both gating matrices (W_g and W_noise)
included, embedding excluded. Training FLOPs = 3 (forward + backward = 2 x forward) x 2 (a multiply-add is
2 FLOPs) x forward MACs. TFLOPS per device = FLOPs of the global batch / (step time x world size).
"""

from __future__ import annotations

from moe_scale.config import ModelConfig


def lstm_macs(d_in: int, d_hidden: int) -> int:
    return 4 * d_hidden * (d_in + d_hidden)


def lstm_moe_forward_macs_per_token(model: ModelConfig, vocab_size: int) -> dict[str, int]:
    """Forward MACs per token of LSTMMoELM by component (the 'ops/timestep' of the paper plus the softmax)."""
    d = model.d_model
    return {
        "lstm": 2 * lstm_macs(d, d),
        "gating": 2 * d * model.num_experts,
        "experts": model.top_k * 2 * d * model.expert_hidden,
        "softmax": d * vocab_size,
    }


def training_flops_per_token(forward_macs: dict[str, int]) -> int:
    return 3 * 2 * sum(forward_macs.values())


def tflops_per_device(flops_per_step: float, step_seconds: float, world_size: int) -> float:
    return flops_per_step / (step_seconds * world_size) / 1e12
