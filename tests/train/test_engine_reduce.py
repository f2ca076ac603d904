"""Stage-0 gradient reduction in place (train/engine.py): DeepSpeed's sums and averages without its flat copies."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
from torch import nn

from tests.multiproc import run_ranks
from tests.moe.layers import moe_layer


def _worker(rank, world, ep_size):
    import torch.distributed as dist
    from moe_scale.train.engine import reduce_gradients_in_place

    model = nn.ModuleDict({"dense": nn.Linear(4, 4), "unused": nn.Linear(4, 4),
                           "moe": moe_layer(4, 8, 4, 2, ep_size=ep_size, ep_rank=rank % ep_size)})
    model["moe"].set_deepspeed_parallelism()
    for name, param in model.named_parameters():
        if not name.startswith("unused"):   # a parameter without a gradient takes part with zeros
            scale = 10.0 if name.startswith("moe.experts") else 1.0
            param.grad = torch.full_like(param, (rank + 1) * scale)
    reduce_gradients_in_place(model, dist.group.WORLD)
    return {name: param.grad.unique().tolist() for name, param in model.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep_size", [1, 2])
def test_sums_and_averages_as_deepspeed_does(ep_size):
    """Dense: the mean over the 2 ranks. Experts: summed over their expert-data-parallel group (both ranks when
    ep_size = 1, none when 2), divided by the data-parallel size either way (DeepSpeed's _reduce_expert_gradients)."""
    results = run_ranks(_worker, world_size=2, args=(ep_size,), deepspeed=True, timeout=60)
    for rank, grads in enumerate(results):
        assert grads["dense.weight"] == grads["dense.bias"] == [1.5]
        assert grads["unused.weight"] == [0.0]
        expected = [15.0] if ep_size == 1 else [(rank + 1) * 10 / 2]
        assert grads["moe.experts.w_in"] == grads["moe.experts.w_out"] == expected
        assert grads["moe.router.w_gate"] == [1.5]   # the flat gate is replicated: dense
