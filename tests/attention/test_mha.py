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
    out, aux = layer(x, head_weights_BTH=weights_BTH)
    assert aux is None
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
    torch.testing.assert_close(layer(x)[0], layer.out_proj.bias.expand(B, T, D))


def test_an_untouched_mask_is_skipped_with_the_same_numbers():
    """Until someone takes head_mask_H the forward skips multiplying by the all-ones mask (a kernel forward and
    one backward, and the mask's cast in bf16): the same output and gradients as with the mask applied;
    reset_unsaved_buffers skips it again."""
    from op_count import OpCounter

    torch.manual_seed(1)
    layer = MultiHeadAttention(D, H, d)
    x = torch.randn(B, T, D, requires_grad=True)
    with OpCounter() as skipped:
        out = layer(x)[0]
    grads = torch.autograd.grad(out.square().sum(), (x, layer.q_proj.weight))
    assert layer.head_mask_H.sum() == H and layer.mask_touched   # taken: applied from now on
    with OpCounter() as applied:
        out_masked = layer(x)[0]
    grads_masked = torch.autograd.grad(out_masked.square().sum(), (x, layer.q_proj.weight))
    assert applied.kernel_ops == skipped.kernel_ops + 1   # the multiplication (bf16: the mask's cast too)
    torch.testing.assert_close(out, out_masked, rtol=0, atol=0)
    for g, w in zip(grads, grads_masked):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    layer.reset_unsaved_buffers()
    assert not layer.mask_touched


def test_queries_keys_and_values_come_from_one_product_of_the_three_projections():
    torch.manual_seed(2)
    layer = MultiHeadAttention(D, H, d)
    x = torch.randn(B, T, D)
    q, k, v = layer._queries_keys_values(x)
    for got, proj in zip((q, k, v), (layer.q_proj, layer.k_proj, layer.v_proj)):
        torch.testing.assert_close(got, proj(x).view(B, T, H, d).transpose(1, 2), rtol=1e-6, atol=1e-6)
