"""The LSTM language model of Shazeer et al. 2017, App. C.1.

Legend (docs/shapes.md): B sequences, T positions, N tokens (B·T), D model width.

    embedding ─▶ LSTM ─▶ MoE ─▶ LSTM ─▶ softmax                (--layout lstm-moe-lstm, the default)

and App. C.1's computationally matched baselines: `lstm-ffn-lstm` (MoE-1-Deep: one dense "expert" of
--ffn-layers ReLU layers), `4xlstm` (4xLSTM-512: two more LSTMs instead of the MoE) and `lstm` (one LSTM,
LSTM-2048-512). MoE-1-Wide is the default layout with one expert. LSTMs wider than d_model
(--lstm-hidden) project back to d_model (Sak et al. 2014; torch's `proj_size`).

Every layer but the softmax: dropout on its output, then a residual add of its input
(`y = x + Dropout(f(x))`; the embedding has no input to add). The MoE output passes through a sigmoid
before the dropout. Legend: B sequences, T time steps, D model dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_scale.config import RunConfig
from moe_scale.models.dense_ffn import ReLUStack
from moe_scale.models.build_softmax import build_softmax
from moe_scale.moe.deepspeed_adapter import ExpertParallelModule
from moe_scale.moe.build import build_moe_layer
from moe_scale.moe.layer import MoELayer


@dataclass
class LMOutput:
    nll_sum: torch.Tensor     # summed token NLL of the batch (float32 scalar)
    num_tokens: int
    aux_loss: torch.Tensor    # sum of the MoE layers' balancing losses


class LSTMMoELM(nn.Module):
    def __init__(self, config: RunConfig, vocab_size: int, ep_size: int = 1, ep_rank: int = 0, seed: int = 0,
                 counts: list[int] | None = None):
        """Built from config.model (width, dropout, config.model.lstm), config.moe and config.softmax (`counts`:
        the vocabulary's training counts, models/build_softmax.py). `ep_rank` selects which slice of the experts
        this process holds; `seed` seeds the experts' init (the rest uses the global RNG, which the caller seeds
        identically on every rank)."""
        super().__init__()
        model, lstm = config.model, config.model.lstm
        d = model.d_model
        self.layout = lstm.layout
        self.embedding = nn.Embedding(vocab_size, d)
        self.lstm1 = _lstm(d, lstm.hidden)
        if lstm.layout == "lstm-moe-lstm":
            self.moe = build_moe_layer(config.moe, d, ep_size=ep_size, ep_rank=ep_rank, seed=seed,
                                       kind=config.expert_kind)
        elif lstm.layout == "lstm-ffn-lstm":
            self.ffn = ReLUStack(d, config.moe.experts.hidden, lstm.ffn_layers)
        elif lstm.layout == "4xlstm":
            self.middle_lstms = nn.ModuleList([_lstm(d, lstm.hidden), _lstm(d, lstm.hidden)])
        if lstm.layout != "lstm":
            self.lstm2 = _lstm(d, lstm.hidden)
        self.dropout = nn.Dropout(model.dropout)
        self.softmax = build_softmax(config.softmax, d, vocab_size, counts)

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, ExpertParallelModule)]

    def forward(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> LMOutput:
        B, T = inputs_BT.shape
        h_BTD = self.dropout(self.embedding(inputs_BT))
        h_BTD = h_BTD + self.dropout(self.lstm1(h_BTD)[0])
        aux_loss = h_BTD.new_zeros(())
        if self.layout in ("lstm-moe-lstm", "lstm-ffn-lstm"):
            x_ND = h_BTD.reshape(B * T, -1)
            if self.layout == "lstm-moe-lstm":
                mid_ND, aux_loss = self.moe(x_ND, seq_len=T)
            else:
                mid_ND = self.ffn(x_ND)
            h_BTD = h_BTD + self.dropout(torch.sigmoid(mid_ND)).view(B, T, -1)
        for lstm in getattr(self, "middle_lstms", []):
            h_BTD = h_BTD + self.dropout(lstm(h_BTD)[0])
        if self.layout != "lstm":
            h_BTD = h_BTD + self.dropout(self.lstm2(h_BTD)[0])
        nll_N = self.softmax(h_BTD.reshape(B * T, -1), targets_BT.reshape(-1))
        return LMOutput(nll_N.sum(), B * T, aux_loss)


    @torch.no_grad()
    def decode(self, inputs_BT: torch.Tensor, state: dict | None = None) -> tuple[torch.Tensor, dict]:
        """Generation (eval mode): log p(next word) after each input position [B, T, V], continuing from `state`
        (each LSTM's (h, c) after the previous inputs; None: the start), and the state after these inputs. Each
        new word costs one step of every layer, never a re-run of the prefix."""
        B, T = inputs_BT.shape
        state, new = state or {}, {}

        def lstm(name: str, module: nn.LSTM, x_BTD: torch.Tensor) -> torch.Tensor:
            out_BTD, new[name] = module(x_BTD, state.get(name))
            return out_BTD

        h_BTD = self.embedding(inputs_BT)
        h_BTD = h_BTD + lstm("lstm1", self.lstm1, h_BTD)
        if self.layout in ("lstm-moe-lstm", "lstm-ffn-lstm"):
            x_ND = h_BTD.reshape(B * T, -1)
            mid_ND = self.moe(x_ND)[0] if self.layout == "lstm-moe-lstm" else self.ffn(x_ND)
            h_BTD = h_BTD + torch.sigmoid(mid_ND).view(B, T, -1)
        for i, middle in enumerate(getattr(self, "middle_lstms", [])):
            h_BTD = h_BTD + lstm(f"middle{i}", middle, h_BTD)
        if self.layout != "lstm":
            h_BTD = h_BTD + lstm("lstm2", self.lstm2, h_BTD)
        return self.softmax.log_probs(h_BTD.reshape(B * T, -1)).view(B, T, -1), new


def _lstm(d_model: int, hidden: int) -> nn.LSTM:
    units = hidden or d_model
    return nn.LSTM(d_model, units, batch_first=True, proj_size=d_model if units != d_model else 0)
