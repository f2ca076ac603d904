"""--a2a-chunks: the MoE layer's exchange in pieces (moe/dispatch/pieces.py) gives the outputs and gradients of
one piece, on 2 and 4 ranks, flat and hierarchical all-to-all, dropless (with and without a rank budget) and
capacity dispatch, with shared experts computed while the first piece travels; and the host reads no more counts
however many pieces."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from op_count import OpCounter
from tests.moe.layers import moe_layer
from tests.multiproc import run_ranks

D, H, E, K, N = 8, 16, 8, 2, 24
CHUNKS = (1, 2, 4)
MODES = {"dropless": {}, "budget": {"rank_capacity_factor": 1.0},
         "capacity": {"dispatch_mode": "capacity", "capacity_factor": 0.75}}


def _layer(world, rank, all_to_all, settings):
    layer = moe_layer(D, H, E, K, ep_size=world, ep_rank=rank, seed=3, all_to_all=all_to_all, node_size=2,
                      shared_experts=1, **settings).double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer.router.w_gate.copy_(torch.randn(D, E, generator=gen, dtype=torch.float64))
    layer.set_deepspeed_parallelism()
    layer.eval()   # no noise: every piece count routes the same
    return layer


def _worker(rank, world, all_to_all):
    gen = torch.Generator().manual_seed(10 + rank)
    x0, upstream = torch.randn(N, D, generator=gen, dtype=torch.float64), torch.randn(N, D, generator=gen,
                                                                                      dtype=torch.float64)
    got = {}
    for mode, settings in MODES.items():
        layer = _layer(world, rank, all_to_all, settings)
        for chunks in CHUNKS:
            layer.a2a_chunks = chunks
            layer.zero_grad()
            x = x0.clone().requires_grad_(True)
            calls = layer.dispatcher.timer.calls
            with OpCounter() as counted:
                y, aux = layer(x)
            (y * upstream).sum().backward()
            got[mode, chunks] = {"y": y.detach(), "x_grad": x.grad, "reads": counted.host_syncs,
                                 "exchanges": layer.dispatcher.timer.calls - calls,
                                 "dropped": float(layer.stats.metrics.get("dropped_fraction", 0.0)),
                                 "grads": {n: p.grad.clone() for n, p in layer.named_parameters()
                                           if p.grad is not None}}
    return got


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,all_to_all", [(2, "flat"), (4, "flat"), (4, "hierarchical")])
def test_pieces_equal_one_exchange(world, all_to_all):
    for rank, got in enumerate(run_ranks(_worker, world_size=world, args=(all_to_all,), deepspeed=True,
                                         timeout=120)):
        for mode in MODES:
            one = got[mode, 1]
            assert one["grads"].keys() >= {"experts.w_in", "experts.w_out", "router.w_gate", "shared.w_in"}
            for chunks in CHUNKS[1:]:
                piece = got[mode, chunks]
                where = f"rank {rank}, {mode}, {chunks} pieces"
                torch.testing.assert_close(piece["y"], one["y"], rtol=1e-12, atol=1e-12, msg=lambda m: f"{where}: {m}")
                torch.testing.assert_close(piece["x_grad"], one["x_grad"], rtol=1e-12, atol=1e-12,
                                           msg=lambda m: f"{where}: {m}")
                assert piece["grads"].keys() == one["grads"].keys(), where
                for name, grad in one["grads"].items():
                    torch.testing.assert_close(piece["grads"][name], grad, rtol=1e-12, atol=1e-12,
                                               msg=lambda m, name=name: f"{where}, {name}: {m}")
                assert piece["reads"] == one["reads"], where   # one plan for all the pieces
                assert piece["exchanges"] > one["exchanges"], where   # the pieces did travel apart
                assert piece["dropped"] == one["dropped"], where
            assert (one["dropped"] > 0) == (mode != "dropless"), (mode, one["dropped"])
