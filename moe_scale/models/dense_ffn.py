"""The dense feed-forward blocks of the models (the MoE layer's experts are moe/experts/).

Legend (docs/shapes.md): B sequences, T positions, N tokens (B·T), D model width.

    ReLUStack  d -> h (ReLU) -> ... -> h (ReLU) -> d without biases: MoE-1-Deep's single always-active
               "expert" in the LSTM LM (Shazeer et al. App. C.1; a one-expert gate always outputs 1)
    GELUFFN    d -> h (GELU) -> d with biases: the transformer's dense feed-forward
    SwiGLUFFN  d -> h (silu(x W_gate) * x W_up) -> d without biases: the llama block's (Llama's LlamaMLP; named
               as transformers names its matrices)
"""

from __future__ import annotations

import torch
from torch import nn


class ReLUStack(nn.Module):
    def __init__(self, d_model: int, d_hidden: int, hidden_layers: int):
        super().__init__()
        widths = [d_model] + [d_hidden] * hidden_layers
        self.hidden = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(widths, widths[1:]))
        self.out = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden:
            x_ND = torch.relu(layer(x_ND))
        return self.out(x_ND)


class GELUFFN(nn.Module):
    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.up = nn.Linear(d_model, d_hidden)
        self.down = nn.Linear(d_hidden, d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x_BTD)))


class SwiGLUFFN(nn.Module):
    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.up_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.down_proj = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))
