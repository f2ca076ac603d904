"""Next-word choice from log-probabilities: greedy, or a draw after temperature, top-k and top-p (nucleus)
filtering. Legend: B sequences, V vocabulary.

Legend (docs/shapes.md): B sequences, V vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_scale.errors import UserError


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 0          # 0: no top-k filter
    top_p: float = 1.0      # 1: no nucleus filter
    greedy: bool = False

    def validate(self) -> None:
        if not self.greedy and not self.temperature > 0:
            raise UserError(f"--temperature must be positive (got {self.temperature}); for the most likely word "
                            f"every step pass --greedy")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must lie in (0, 1] (got {self.top_p}); 1 keeps every word")
        if self.top_k < 0:
            raise UserError(f"--top-k must be 0 (no filter) or positive (got {self.top_k})")


def filtered_logits(log_probs_BV: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Logits after temperature, top-k and top-p: words filtered out get -inf (the most likely word never is). The
    most likely word's log-probability is taken off before dividing by the temperature, so the best word's logit
    is 0 and the others' at most 0: a tiny temperature sends them to -inf (the argmax), never to inf - inf; in
    float64, where any positive temperature a float holds is not 0."""
    log_probs_BV = log_probs_BV.double()
    logits_BV = (log_probs_BV - log_probs_BV.max(dim=-1, keepdim=True).values) / config.temperature
    if 0 < config.top_k < logits_BV.shape[-1]:
        kth_B1 = logits_BV.topk(config.top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if config.top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        before_BV = sorted_BV.softmax(dim=-1).cumsum(dim=-1) - sorted_BV.softmax(dim=-1)   # mass of better words
        drop_BV = before_BV >= config.top_p   # keep the smallest prefix whose mass reaches top_p
        drop_in_place_BV = torch.zeros_like(drop_BV).scatter(-1, order_BV, drop_BV)   # back to word order
        logits_BV = logits_BV.masked_fill(drop_in_place_BV, float("-inf"))
    return logits_BV


def next_words(log_probs_BV: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """[B] word ids: the argmax with `greedy`, else one draw from the filtered distribution."""
    if config.greedy:
        return log_probs_BV.argmax(dim=-1)
    probs_BV = filtered_logits(log_probs_BV, config).softmax(dim=-1)
    return torch.multinomial(probs_BV.cpu(), 1, generator=generator)[:, 0].to(log_probs_BV.device)
