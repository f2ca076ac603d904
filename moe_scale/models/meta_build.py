"""Build a model on the meta device: shapes and parameter counts of any size, no memory.

`GroupedExperts.reset_parameters` initialises expert by expert with a CPU generator (so an expert starts
the same on whichever rank holds it). On meta there is nothing to initialise, and looping over 131072
experts drawing 2 x 512k CPU numbers each would take hours, so it is skipped while building here.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from moe_scale.config import ModelConfig
from moe_scale.moe.experts import GroupedExperts


@contextlib.contextmanager
def _skip_expert_init_on_meta() -> Iterator[None]:
    original = GroupedExperts.reset_parameters

    def reset_unless_meta(self: GroupedExperts) -> None:
        if not self.w_in.is_meta:
            original(self)

    GroupedExperts.reset_parameters = reset_unless_meta
    try:
        yield
    finally:
        GroupedExperts.reset_parameters = original


def build_lstm_lm_on_meta(model: ModelConfig, vocab_size: int) -> torch.nn.Module:
    from moe_scale.models.lstm_lm import LSTMMoELM

    with _skip_expert_init_on_meta(), torch.device("meta"):
        return LSTMMoELM(model, vocab_size)


def parameter_counts(module: torch.nn.Module) -> dict[str, int]:
    """Parameters per top-level child ('embedding', 'lstm1', 'moe', 'softmax', ...)."""
    counts: dict[str, int] = {}
    for name, param in module.named_parameters():
        top = name.split(".")[0]
        counts[top] = counts.get(top, 0) + param.numel()
    return counts
