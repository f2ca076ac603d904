"""MAE (spec §4): uniform gate == MHA, an F step == h/(h−1) × MHA with one head masked, the causal prefix
mean, and block coordinate descent: G steps change only φ, F steps never change φ."""

from __future__ import annotations

import math

import pytest
import torch

from moe_scale.attention.mae import MAEAttention, causal_window_mean
from moe_scale.config import RunConfig
from moe_scale.models.transformer_lm import TransformerLM
from moe_scale.train.engine import optimizer_groups
from moe_scale.train.mae_bcd import MAEBlockCoordinateDescent, mae_schedule

D, H, B, T = 16, 4, 3, 6


def _layer() -> MAEAttention:
    torch.manual_seed(0)
    return MAEAttention(D, H, D // H)


def _set_gate_logits(layer: MAEAttention, bias: list[float]) -> None:
    with torch.no_grad():
        layer.gate.out.weight.zero_()
        layer.gate.out.bias.copy_(torch.tensor(bias))


def test_uniform_gate_equals_mha():
    layer = _layer().eval()
    _set_gate_logits(layer, [0.0] * H)
    x = torch.randn(B, T, D)
    torch.testing.assert_close(layer(x)[0], layer.mha(x)[0])
    g = layer.last_gates_BTH
    entropy = -(g * g.log()).sum(-1)
    torch.testing.assert_close(entropy, torch.full_like(entropy, math.log(H)))


def test_mixture_weights_sum_to_h():
    layer = _layer()
    gates = torch.softmax(torch.randn(B, T, H), -1)
    torch.testing.assert_close(layer.head_weights(gates).sum(-1), torch.full((B, T), float(H)))


@pytest.mark.parametrize("expert", [0, 2])
def test_f_step_is_scaled_mha_with_one_head_masked(expert):
    layer = _layer().train()
    bias = [0.0] * H
    bias[expert] = 60.0          # g_expert = 1 - 1e-26: the sample is this expert
    _set_gate_logits(layer, bias)
    layer.mode = "sample"
    x = torch.randn(B, T, D)
    f_step = layer(x)[0]
    layer.mha.head_mask_H[expert] = 0.0
    masked = layer.mha(x)[0]
    out_bias = layer.mha.out_proj.bias
    torch.testing.assert_close(f_step - out_bias, H / (H - 1) * (masked - out_bias), rtol=1e-5, atol=1e-6)


def test_sampling_draws_experts_by_the_gate_and_eval_uses_the_mixture():
    layer = _layer().train()
    _set_gate_logits(layer, [math.log(p) for p in (0.1, 0.2, 0.3, 0.4)])
    layer.mode = "sample"
    torch.manual_seed(1)
    gates = layer.gate(torch.randn(200, 50, D)).detach()
    dropped = (layer.head_weights(gates) == 0).float().reshape(-1, H).mean(0)
    torch.testing.assert_close(dropped, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.01, rtol=0)
    layer.eval()    # evaluation: deterministic mixture even in "sample" mode
    x = torch.randn(B, T, D)
    torch.testing.assert_close(layer(x)[0], layer(x)[0])


def test_causal_window_mean():
    x = torch.randn(2, 9, 3)
    out = causal_window_mean(x, window=4)
    for t in range(9):
        torch.testing.assert_close(out[:, t], x[:, max(0, t - 3): t + 1].mean(1))


def _mae_model() -> tuple[TransformerLM, RunConfig]:
    config = RunConfig.from_settings(model="transformer", attention="mae", d_model=D, num_heads=H, num_layers=2,
                                     ffn_hidden=32, dropout=0.0, mae_g_unit="step", mae_g_every=2)
    torch.manual_seed(0)
    return TransformerLM(config, vocab_size=50), config


def _snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_g_step_changes_only_the_gate_and_f_step_never_the_gate():
    model, config = _mae_model()
    bcd = mae_schedule(model, config, steps_per_epoch=100)
    assert isinstance(bcd, MAEBlockCoordinateDescent)
    gate_names = {n for n, _ in model.named_parameters() if ".gate." in n}
    assert gate_names and all(not p.requires_grad for n, p in model.named_parameters() if n in gate_names)
    grouped = {id(p) for group in optimizer_groups(model) for p in group["params"]}
    assert not grouped & {id(p) for n, p in model.named_parameters() if n in gate_names}   # φ outside the optimizer
    inputs, targets = torch.randint(0, 50, (4, T)), torch.randint(0, 50, (4, T))

    before = _snapshot(model)
    assert bcd.g_step_if_due(0, inputs, targets, device=None)          # step 0: G step
    after = _snapshot(model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == gate_names
    assert all(p.grad is None for p in model.parameters())             # no gradient left for the engine
    assert not bcd.g_step_if_due(1, inputs, targets, device=None)      # every 2nd step only

    optimizer = torch.optim.AdamW(optimizer_groups(model), lr=1e-2)    # the F step, as the engine does it
    out = model(inputs, targets)
    (out.nll_sum / out.num_tokens).backward()
    optimizer.step()
    final = _snapshot(model)
    changed = {n for n in after if not torch.equal(after[n], final[n])}
    assert not changed & gate_names
    assert changed == set(after) - gate_names


def test_joint_training_keeps_the_gate_in_the_optimizer():
    model, config = _mae_model()
    config.attention.mae.training = "joint"
    assert mae_schedule(model, config, steps_per_epoch=10) is None
    assert all(p.requires_grad for p in model.parameters())
    assert all(layer.mode == "mixture" for layer in model.attention_layers())


def test_epoch_schedule():
    model, config = _mae_model()
    config.attention.mae.g_unit, config.attention.mae.g_every = "epoch", 5
    bcd = mae_schedule(model, config, steps_per_epoch=10)
    assert [s for s in range(120) if bcd.is_g_step(s)] == [*range(0, 10), *range(50, 60), *range(100, 110)]
