"""Michel et al. head importance and pruning (spec §5): masked == pruned, importance == |∂L/∂ξ|, per-layer
L2 normalisation, masked heads score 0, pruning a masked head changes nothing, the schedule's errors."""

from __future__ import annotations

import pytest
import torch

from moe_scale.attention.mha import MultiHeadAttention
from moe_scale.attention.prune_schedule import prune_schedule
from moe_scale.attention.pruning import apply_masks, apply_pruning, head_importance, heads_to_prune
from moe_scale.config import RunConfig
from moe_scale.errors import UserError
from moe_scale.models.transformer_lm import TransformerLM

V, D, H, T = 40, 16, 4, 8


def _model(attention="mha", seed=0) -> TransformerLM:
    torch.manual_seed(seed)
    config = RunConfig.from_settings(model="transformer", attention=attention, d_model=D, num_heads=H, num_layers=2,
                         ffn_hidden=32, dropout=0.0)
    return TransformerLM(config, V).eval()


def _batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (2, T), generator=g), torch.randint(0, V, (2, T), generator=g)) for _ in range(n)]


def _nll(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(*batch).nll_sum


@pytest.mark.parametrize("attention", ["mha", "mae"])
def test_masked_equals_pruned(attention):
    heads = [(0, 1), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]     # layer 1 loses every head
    masked, pruned = _model(attention), _model(attention)
    apply_masks(masked, heads)
    apply_pruning(pruned, heads)
    assert [layer.num_heads for layer in (pruned.blocks[0].attn, pruned.blocks[1].attn)
            if isinstance(layer, MultiHeadAttention)] in ([2, 0], [])
    mha0 = pruned.blocks[0].attn if attention == "mha" else pruned.blocks[0].attn.mha
    assert mha0.q_proj.weight.shape == (2 * D // H, D) and mha0.out_proj.weight.shape == (D, 2 * D // H)
    assert sum(p.numel() for p in pruned.parameters()) == sum(p.numel() for p in masked.parameters()) \
        - 6 * (4 * D * (D // H) + 3 * (D // H))                      # spec §5.4: 4·d_m·d_head + 3·d_head per head
    for batch in _batches():
        torch.testing.assert_close(_nll(pruned, batch), _nll(masked, batch), rtol=1e-5, atol=1e-5)


def test_pruning_a_masked_head_changes_nothing():
    model = _model()
    apply_masks(model, [(0, 2)])
    before = [_nll(model, b) for b in _batches()]
    apply_pruning(model, [(0, 2)])
    for b, value in zip(_batches(), before):
        torch.testing.assert_close(_nll(model, b), value)


def test_importance_is_the_mask_gradient_and_normalised_per_layer():
    model, batches = _model(), _batches(n=2)
    scores = head_importance(model, batches, H, abs_granularity="example")
    torch.testing.assert_close(scores.norm(dim=1), torch.ones(2, dtype=torch.float64))
    # brute force: ξ as a leaf, |∂L/∂ξ| per sequence (batch of one), summed, normalised per layer
    layers = [block.attn for block in model.blocks]
    expected = torch.zeros(2, H, dtype=torch.float64)
    for inputs, targets in batches:
        for row in range(inputs.shape[0]):
            xis = [torch.ones(H, requires_grad=True) for _ in layers]
            for layer, xi in zip(layers, xis):
                layer.head_mask_H = xi
            out = model(inputs[row:row + 1], targets[row:row + 1])
            grads = torch.autograd.grad(out.nll_sum / (2 * T), xis)   # the batch's mean CE, this row's part
            for index, g in enumerate(grads):
                expected[index] += g.abs().double()
    for layer in layers:
        layer.head_mask_H = torch.ones(H)
    expected = expected / expected.norm(dim=1, keepdim=True)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-6)


def test_masked_heads_score_zero_and_token_granularity_bounds_example():
    model, batches = _model(), _batches()
    apply_masks(model, [(1, 2)])
    token = head_importance(model, batches, H, abs_granularity="token")
    assert token[1, 2] == 0 and (token[0] > 0).all()
    torch.testing.assert_close(token.norm(dim=1), torch.ones(2, dtype=torch.float64))


def test_global_ascending_order_is_stable_and_skips_pruned():
    scores = torch.tensor([[0.5, 0.1, 0.1], [0.05, 0.9, 0.1]])
    assert heads_to_prune(scores, 3, set()) == [(1, 0), (0, 1), (0, 2)]
    assert heads_to_prune(scores, 2, {(1, 0)}) == [(0, 1), (0, 2)]


def test_schedule_and_its_errors():
    assert prune_schedule(16, 0.1, 10) == [0, 1, 3, 4, 6, 8, 9, 11, 12, 14]
    assert prune_schedule(8, 0.1, 10)[-1] == 7     # never more than the fraction
    for fraction, steps in ((0.0, 10), (1.0, 2), (-0.1, 3), (0.2, 6)):
        with pytest.raises(UserError, match=r"\[0, 1\)|\(0, 1\)"):
            prune_schedule(16, fraction, steps)
