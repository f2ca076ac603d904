"""Perplexity of a model over every window of a split, summed over all data-parallel ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moe_scale.data import LMWindows
from moe_scale.distributed.comm import collective_device
from moe_scale.metrics.balance import MoEMetrics


@torch.no_grad()
def evaluate(model, windows: LMWindows, max_batches: int = 0, device=None) -> dict[str, float]:
    """exp(total NLL / total tokens) over the split (every rank runs the same number of batches, which
    expert-parallel all-to-alls need), plus the MoE balance statistics over the whole pass."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=collective_device())      # [NLL sum, tokens]
    balance = MoEMetrics(model.moe_layers())
    for index, (inputs, targets) in enumerate(windows.all_windows()):
        if max_batches and index >= max_batches:
            break
        out = model(inputs.to(device), targets.to(device))
        totals += torch.tensor([out.nll_sum.item(), out.num_tokens], dtype=torch.float64, device=totals.device)
        balance.add()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    model.train(was_training)
    nll, tokens = totals.tolist()
    return {"ppl": math.exp(nll / tokens), "nll_per_token": nll / tokens, "tokens": int(tokens),
            **balance.values()}
