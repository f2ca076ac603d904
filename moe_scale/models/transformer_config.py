"""Checks of the transformer settings (`--model transformer`), with the fix in every message."""

from __future__ import annotations

from moe_scale.config import ModelConfig
from moe_scale.errors import UserError


def head_width(m: ModelConfig) -> int:
    """Width of one head (MHA/MAE) or one attention expert (MoA): --head-dim, or d_model / heads."""
    if m.head_dim:
        return m.head_dim
    return m.d_model // (m.moa_top_k if m.attention == "moa" else m.num_heads)


def validate_transformer(m: ModelConfig, ep_size: int) -> None:
    positive = {"--num-layers": m.num_layers, "--num-heads": m.num_heads, "--ffn-hidden": m.ffn_hidden,
                "--moa-num-experts": m.moa_num_experts, "--moa-top-k": m.moa_top_k, "--mae-g-every": m.mae_g_every}
    for flag, value in positive.items():
        if value < 1:
            raise UserError(f"{flag} must be at least 1 (got {value})")
    if m.head_dim < 0:
        raise UserError(f"--head-dim must be 0 (d_model / heads) or positive (got {m.head_dim})")
    if m.attention == "moa" and m.moa_top_k > m.moa_num_experts:
        raise UserError(f"--moa-top-k {m.moa_top_k} is larger than --moa-num-experts {m.moa_num_experts}; "
                        f"choose k <= number of attention experts")
    heads, flag = (m.moa_top_k, "--moa-top-k") if m.attention == "moa" else (m.num_heads, "--num-heads")
    if not m.head_dim and m.d_model % heads:
        raise UserError(f"{flag} {heads} does not divide --d-model {m.d_model}; choose a divisor of the width "
                        f"or set --head-dim explicitly")
    if m.attention == "moa":
        if m.moa_num_experts % ep_size:
            raise UserError(f"--moa-num-experts {m.moa_num_experts} is not divisible by --ep-size {ep_size}; "
                            f"each expert-parallel rank must hold the same number of attention experts")
    if m.attention == "mae" and m.num_heads < 2:
        raise UserError(f"--attention mae needs --num-heads >= 2 (experts are groups of h-1 heads; got "
                        f"{m.num_heads})")
    if m.mae_gate_lr <= 0:
        raise UserError(f"--mae-gate-lr must be positive (got {m.mae_gate_lr})")
