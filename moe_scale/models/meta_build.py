"""Build a model on the meta device: shapes and parameter counts of any size, no memory.

(`GroupedExperts.reset_parameters` skips meta tensors: nothing to initialise, and looping over 131072
experts drawing 2 x 512k CPU numbers each would take hours.)
"""

from __future__ import annotations

import torch

from moe_scale.config import RunConfig


def build_lstm_lm_on_meta(config: RunConfig, vocab_size: int) -> torch.nn.Module:
    from moe_scale.models.lstm_lm import LSTMMoELM

    with torch.device("meta"):
        return LSTMMoELM(config, vocab_size)


def parameters_per_child(module: torch.nn.Module) -> dict[str, int]:
    """Parameters per top-level child ('embedding', 'lstm1', 'moe', 'softmax', ...)."""
    counts: dict[str, int] = {}
    for name, param in module.named_parameters():
        top = name.split(".")[0]
        counts[top] = counts.get(top, 0) + param.numel()
    return counts
