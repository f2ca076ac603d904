"""Generation's incremental decoding (models' `decode`): the LSTM carrying its state and the transformer its KV
cache (MHA, MAE's gate window too, MoA's shared K/V, the llama block's rotary positions) give, token by token,
the same next-word distributions as the training forward over the whole sequence, for every model kind, dense or
MoE."""

from __future__ import annotations

import pytest
import torch

from moe_scale.config import RunConfig
from moe_scale.models.build import build_model

V, T, B = 40, 9, 2

MODELS = {
    "lstm-moe-lstm": dict(model="lstm", layout="lstm-moe-lstm", gate="noisy_topk"),
    "lstm-moe-lstm-hierarchical": dict(model="lstm", layout="lstm-moe-lstm", gate="hierarchical", num_groups=2),
    "lstm-moe-lstm-batchwise": dict(model="lstm", layout="lstm-moe-lstm", gate="batchwise"),
    "4xlstm": dict(model="lstm", layout="4xlstm"),
    "lstm-ffn-lstm": dict(model="lstm", layout="lstm-ffn-lstm"),
    "mha-dense": dict(model="transformer", attention="mha", ffn="dense"),
    "mha-moe": dict(model="transformer", attention="mha", ffn="moe", gate="noisy_topk"),
    "mae-dense": dict(model="transformer", attention="mae", ffn="dense"),
    "moa-moe": dict(model="transformer", attention="moa", ffn="moe", gate="softmax_topk", moa_num_experts=4,
                    moa_top_k=2),
    "llama-dense-tied": dict(model="transformer", block="llama", ffn="dense", tie_embeddings=True),
    "llama-moe": dict(model="transformer", block="llama", ffn="moe", gate="softmax_topk", moa_renormalize="full"),
}


def _model(settings: dict):
    config = RunConfig.from_settings(d_model=16, num_experts=4, top_k=2, expert_hidden=16, dropout=0.0,
                                     num_layers=2, ffn_hidden=32, **settings)
    torch.manual_seed(0)
    model = build_model(config, V).eval()
    with torch.no_grad():   # an MAE gate with real running statistics, not the identity it starts as
        for module in model.modules():
            if hasattr(module, "running_var"):
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2.0)
    return model


def _forward_nll(model, inputs_BT) -> torch.Tensor:
    """Per-position NLL of the next word from the training forward: differences of prefix sums [B, T-1]."""
    nll = []
    for t in range(1, inputs_BT.shape[1]):
        row_sums = [model(inputs_BT[b:b + 1, :t], inputs_BT[b:b + 1, 1:t + 1]).nll_sum for b in range(B)]
        nll.append(torch.stack(row_sums))
    per_prefix = torch.stack(nll, dim=1)   # [B, T-1]: summed NLL of the first t targets
    return torch.diff(per_prefix, dim=1, prepend=torch.zeros(B, 1))


@pytest.mark.parametrize("name", MODELS)
def test_decoding_word_by_word_equals_the_full_forward(name):
    model = _model(MODELS[name])
    inputs_BT = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = _forward_nll(model, inputs_BT)
    whole, _ = model.decode(inputs_BT[:, :-1])
    prefix, state = model.decode(inputs_BT[:, :3])
    steps = [prefix]
    for t in range(3, T - 1):
        log_probs, state = model.decode(inputs_BT[:, t:t + 1], state)
        steps.append(log_probs)
    stepped = torch.cat(steps, dim=1)
    targets = inputs_BT[:, 1:, None]
    for log_probs in (whole, stepped):
        assert log_probs.shape == (B, T - 1, V)
        torch.testing.assert_close(torch.logsumexp(log_probs, -1), torch.zeros(B, T - 1), atol=1e-5, rtol=0)
        torch.testing.assert_close(-log_probs.gather(2, targets)[..., 0], reference, atol=2e-5, rtol=1e-5)
