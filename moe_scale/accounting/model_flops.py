"""A run's model's forward multiply-adds per token by component, whichever model it is (the LSTM LM's count in
flops.py, the transformer's in attention_flops.py): what `train` reports TFLOPS with, and the planner plans with."""

from __future__ import annotations

from moe_scale.accounting.attention_flops import transformer_forward_macs_per_token
from moe_scale.accounting.flops import lstm_moe_forward_macs_per_token
from moe_scale.config import RunConfig


def forward_macs_per_token(config: RunConfig, vocab_size: int, seq_len: int) -> dict[str, int]:
    """With a full softmax (the trainer substitutes its own softmax's)."""
    if config.model.kind == "transformer":
        return transformer_forward_macs_per_token(config, vocab_size, seq_len)
    return lstm_moe_forward_macs_per_token(config, vocab_size)
