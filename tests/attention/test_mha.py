"""Multi-head attention against a per-head loop; masks and per-token head weights."""

from __future__ import annotations

import math

import torch

from moe_scale.attention.mha import MultiHeadAttention

D, H, d, B, T = 12, 3, 4, 2, 5


def test_matches_per_head_loop_with_mask_and_weights():
    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, d).eval()
    x = torch.randn(B, T, D)
    weights_BTH = torch.rand(B, T, H)
    layer.head_mask_H[1] = 0.0
    out = layer(x, head_weights_BTH=weights_BTH)
    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    ctx = torch.zeros(B, T, H * d)
    for h in range(H):
        cols = slice(h * d, (h + 1) * d)
        scores = q[..., cols] @ k[..., cols].transpose(1, 2) / math.sqrt(d)
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        ctx[..., cols] = torch.softmax(scores, -1) @ v[..., cols] * (weights_BTH[..., h:h + 1] * (h != 1))
    torch.testing.assert_close(out, layer.out_proj(ctx), rtol=1e-5, atol=1e-6)


def test_all_heads_pruned_leaves_the_output_bias():
    layer = MultiHeadAttention(D, H, d)
    layer.prune_heads({0, 1, 2})
    x = torch.randn(B, T, D)
    torch.testing.assert_close(layer(x), layer.out_proj.bias.expand(B, T, D))
