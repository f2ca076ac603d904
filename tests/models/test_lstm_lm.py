"""The LSTM LM follows Shazeer et al. App. C.1: emb → LSTM → MoE(sigmoid) → LSTM → softmax, residual adds."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
import torch.nn.functional as F

from moe_scale.config import RunConfig
from moe_scale.accounting.flops import lstm_moe_forward_macs_per_token, training_flops_per_token
from moe_scale.models.lstm_lm import LSTMMoELM


def small_model(dropout=0.0) -> LSTMMoELM:
    torch.manual_seed(0)
    config = RunConfig.from_settings(d_model=16, expert_hidden=24, num_experts=4, top_k=2, dropout=dropout)
    model = LSTMMoELM(config, vocab_size=50, seed=3)
    with torch.no_grad():   # non-trivial routing
        model.moe.router.w_gate.normal_(0, 1.0)
    return model


def test_forward_is_the_papers_layer_stack():
    model = small_model().eval()
    inputs, targets = torch.randint(0, 50, (3, 7)), torch.randint(0, 50, (3, 7))
    out = model(inputs, targets)

    h0 = model.embedding(inputs)
    h1 = h0 + model.lstm1(h0)[0]
    moe, aux = model.moe(h1.reshape(21, 16))
    h2 = h1 + torch.sigmoid(moe).view(3, 7, 16)
    h3 = h2 + model.lstm2(h2)[0]
    nll = F.cross_entropy(model.softmax.proj(h3).reshape(21, 50), targets.reshape(-1), reduction="sum")
    assert out.num_tokens == 21
    torch.testing.assert_close(out.nll_sum, nll)
    torch.testing.assert_close(out.aux_loss, aux)


def test_dropout_only_in_training_and_gradients_reach_every_parameter():
    model = small_model(dropout=0.5)
    inputs, targets = torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (2, 5))
    model.eval()
    assert model(inputs, targets).nll_sum == model(inputs, targets).nll_sum
    model.train()
    out = model(inputs, targets)
    (out.nll_sum / out.num_tokens + out.aux_loss).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_analytic_macs_match_the_parameter_shapes():
    config = RunConfig.from_settings(d_model=16, expert_hidden=24, num_experts=4, top_k=2)
    macs = lstm_moe_forward_macs_per_token(config, vocab_size=50)
    model = LSTMMoELM(config, vocab_size=50)
    lstm_weights = sum(p.numel() for n, p in model.named_parameters() if "lstm" in n and "weight" in n)
    assert macs["lstm"] == lstm_weights                         # one MAC per weight per token
    assert macs["gating"] == model.moe.router.w_gate.numel() + model.moe.router.w_noise.numel()
    assert macs["experts"] == 2 * (model.moe.experts.w_in[0].numel() + model.moe.experts.w_out[0].numel())
    assert macs["softmax"] == model.softmax.proj.weight.numel()
    assert training_flops_per_token(macs) == 6 * sum(macs.values())


@pytest.mark.parametrize("gate", ["noisy_topk", "hierarchical"])
def test_parameter_counts_are_the_same_for_every_expert_parallel_rank_and_size(gate):
    """Every expert, and the hierarchical gate's secondary matrices sharded with them, counted once over the ranks."""
    from moe_scale.models.build import build_model, parameter_counts

    config = RunConfig.from_settings(d_model=16, layout="lstm-moe-lstm", gate=gate, num_experts=16, num_groups=4,
                                     top_k=2, top_k_secondary=2, expert_hidden=8)
    whole = build_model(config, 100)
    counts = parameter_counts(whole)
    assert counts == {"total": sum(p.numel() for p in whole.parameters()), "experts": 16 * 2 * 16 * 8}
    for ep_size in (2, 4):
        for ep_rank in range(ep_size):
            part = build_model(config, 100, ep_size=ep_size, ep_rank=ep_rank)
            assert parameter_counts(part) == counts
            if gate == "hierarchical":
                assert part.moe.router.w_gate_secondary.shape == (4 // ep_size, 16, 4)
