"""--expert-recompute (App. D): a full LSTM-MoE training step gives the same gradients with and without it,
and really stores less for the backward pass."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from moe_scale.config import RunConfig
from moe_scale.models.lstm_lm import LSTMMoELM


def _step(recompute: bool):
    torch.manual_seed(0)
    config = RunConfig.from_settings(d_model=16, expert_hidden=64, num_experts=8, top_k=2, dropout=0.1,
                         expert_recompute=recompute)
    model = LSTMMoELM(config, vocab_size=40, seed=5).train()
    gen = torch.Generator().manual_seed(1)
    inputs, targets = torch.randint(0, 40, (4, 12), generator=gen), torch.randint(0, 40, (4, 12), generator=gen)
    saved_bytes = [0]

    def pack(t):
        saved_bytes[0] += t.numel() * t.element_size()
        return t

    torch.manual_seed(2)   # the same dropout masks and gate noise in both runs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(inputs, targets)
        loss = out.nll_sum / out.num_tokens + out.aux_loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved_bytes[0]


def test_recompute_gives_identical_gradients_and_saves_less():
    loss_off, grads_off, saved_off = _step(False)
    loss_on, grads_on, saved_on = _step(True)
    assert torch.equal(loss_off, loss_on)
    assert grads_off.keys() == grads_on.keys()
    for name in grads_off:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=0, atol=0, msg=name)
    assert grads_off["moe.experts.w_in"].abs().sum() > 0
    # without recompute the backward keeps the experts' hidden activations [M, H] (and the ReLU's output);
    # with it, only the experts' inputs: at least M*H*4 bytes less (M = 4*12 tokens x k=2 copies, H = 64)
    assert saved_off - saved_on >= 4 * 12 * 2 * 64 * 4
