"""Analytic parameter and MAC counts of the attention variants and the transformer LM.

MoA's own formulas (Zhang et al. 2022, eq. 18-20; spec §3.3), per sequence of T tokens:

    MACs_MoA = k·T²·d_h + 2(k+1)·T·d_h·d_m     (one T² term, QKᵀ, as the paper counts it; no router)
    MACs_MHA = T²·d_m + 4·T·d_m²
    params_MoA = (2E + 2)·d_h·d_m  (+ d_m·E for the router, which the paper's eq. 20 leaves out)

The transformer's per-token accounting divides these by T with T = the training window, and, like the
paper, counts the full T² score matrix (a causal model could skip half of it). The llama block's SwiGLU FFNs
and experts have three matrices (2 for GELU / ReLU); its rotary positions and RMSNorms are not counted (O(d)
per token, like the LayerNorms).
"""

from __future__ import annotations

from moe_scale.config import RunConfig


def moa_macs(T: int, d_model: int, head_dim: int, k: int) -> int:
    return k * T * T * head_dim + 2 * (k + 1) * T * head_dim * d_model


def mha_macs(T: int, d_model: int) -> int:
    return T * T * d_model + 4 * T * d_model * d_model


def moa_params(num_experts: int, d_model: int, head_dim: int, with_router: bool = True) -> int:
    return (2 * num_experts + 2) * head_dim * d_model + (d_model * num_experts if with_router else 0)


def transformer_forward_macs_per_token(config: RunConfig, vocab_size: int, seq_len: int) -> dict[str, int]:
    """Forward MACs per token of TransformerLM by component (active experts only)."""
    from moe_scale.accounting.flops import active_experts, expert_macs, moe_gating, shared_experts

    attn, transformer = config.attention, config.model.transformer
    d, T = config.model.d_model, seq_len
    h = attn.head_width(d)
    if attn.kind == "moa":
        attention = moa_macs(T, d, h, attn.moa.top_k) // T + d * attn.moa.num_experts
    else:
        width = attn.num_heads * h   # eq. 19 with the attention width H·d_h in place of d_m
        attention = T * width + 4 * d * width
        if attn.kind == "mae":
            from moe_scale.attention.mae import GATE_HIDDEN

            attention += d * GATE_HIDDEN + GATE_HIDDEN * attn.num_heads
    if transformer.ffn == "dense":   # the llama block's SwiGLU: gate, up and down; the default block's GELU: up, down
        from moe_scale.models.blocks import block_kind

        ffn = block_kind(config).dense_ffn_matrices * d * transformer.ffn_hidden
    else:
        ffn = moe_gating(config)[1] + active_experts(config) * expert_macs(config, config.moe.experts.hidden) \
            + shared_experts(config)
    return {"attention": transformer.num_layers * attention, "ffn": transformer.num_layers * ffn,
            "softmax": d * vocab_size}
