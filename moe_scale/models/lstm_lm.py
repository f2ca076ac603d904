"""The LSTM language model of Shazeer et al. 2017, App. C.1.

    embedding ─▶ LSTM ─▶ MoE ─▶ LSTM ─▶ softmax

Every layer but the softmax: dropout on its output, then a residual add of its input
(`y = x + Dropout(f(x))`; the embedding has no input to add). The MoE output passes through a sigmoid
before the dropout. Legend: B sequences, T time steps, D model dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_scale.config import ModelConfig
from moe_scale.moe.gates import build_router
from moe_scale.moe.layer import MoELayer
from moe_scale.models.softmax import FullSoftmax


@dataclass
class LMOutput:
    nll_sum: torch.Tensor     # summed token NLL of the batch (float32 scalar)
    num_tokens: int
    aux_loss: torch.Tensor    # sum of the MoE layers' balancing losses


class LSTMMoELM(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int, ep_size: int = 1, ep_rank: int = 0, seed: int = 0):
        """`ep_rank` selects which slice of the experts this process holds; `seed` seeds the experts' init
        (the rest uses the global RNG, which the caller seeds identically on every rank)."""
        super().__init__()
        d = config.d_model
        self.embedding = nn.Embedding(vocab_size, d)
        self.lstm1 = nn.LSTM(d, d, batch_first=True)
        self.moe = MoELayer(d, config.expert_hidden, config.num_experts, config.top_k, ep_size=ep_size,
                            ep_rank=ep_rank, seed=seed, router=build_router(config),
                            recompute=config.expert_recompute, dispatch_mode=config.dispatch,
                            capacity_factor=config.capacity_factor)
        self.lstm2 = nn.LSTM(d, d, batch_first=True)
        self.dropout = nn.Dropout(config.dropout)
        self.softmax = FullSoftmax(d, vocab_size)

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def forward(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> LMOutput:
        B, T = inputs_BT.shape
        h_BTD = self.dropout(self.embedding(inputs_BT))
        h_BTD = h_BTD + self.dropout(self.lstm1(h_BTD)[0])
        moe_ND, aux_loss = self.moe(h_BTD.reshape(B * T, -1))
        h_BTD = h_BTD + self.dropout(torch.sigmoid(moe_ND)).view(B, T, -1)
        h_BTD = h_BTD + self.dropout(self.lstm2(h_BTD)[0])
        nll_N = self.softmax(h_BTD.reshape(B * T, -1), targets_BT.reshape(-1))
        return LMOutput(nll_N.sum(), B * T, aux_loss)
