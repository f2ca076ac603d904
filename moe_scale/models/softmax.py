"""Output layers: hidden states -> per-token negative log-likelihood.

Legend: N tokens, D hidden dim, V vocabulary size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FullSoftmax(nn.Module):
    """The exact softmax over the whole vocabulary (a linear layer with bias, then log-softmax)."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size)

    def forward(self, h_ND: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        """Per-token NLL [N] in float32."""
        logits_NV = self.proj(h_ND).float()
        return F.cross_entropy(logits_NV, targets_N, reduction="none")
