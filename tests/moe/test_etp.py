"""Expert tensor parallelism (--etp-size): each expert's hidden units split over T ranks. A shard is the whole
expert's slice (gated kinds: the gate's and the up projection's rows apart) and joins back; 2 ranks (EP 1 x ETP 2)
and 4 ranks (EP 2 x ETP 2) equal one process with whole experts: outputs, input and router gradients, and each
shard's weight gradients the slice of the whole gradient; dropless, capacity and in overlapped pieces; with the
hierarchical gate, whose secondary gates are copied on the shards' ranks, with noise keyed or sent with the rows."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from moe_scale.moe.experts.kinds import expert_kind
from moe_scale.moe.routed_layer import real_tokens
from moe_scale.moe.router import GlobalTokenNoise, HierarchicalRouter
from tests.moe.layers import hierarchical_layer, moe_layer, randomized
from tests.multiproc import run_ranks

D, H, E, K, N = 8, 16, 4, 2, 12
CASES = {"relu": {}, "swiglu": {}, "capacity": {"dispatch_mode": "capacity", "capacity_factor": 0.75},
         "pieces": {"a2a_chunks": 2},
         # the hierarchical gate (2 groups of 2 experts): noise keyed by row, noise drawn per rank and sent with the
         # rows (a sampler without `rows`), and capacity per group without noise
         "hier_keys": {}, "hier_sent": {}, "hier_capacity": {"dispatch_mode": "capacity", "capacity_factor": 0.75}}
NOISY = ("hier_keys", "hier_sent")
PADDED = ("hier_keys", "hier_capacity")   # each rank's last 3 rows are padding (evaluation's last windows)


@pytest.mark.parametrize("kind", ["relu", "swiglu", "geglu"])
def test_shards_are_slices_of_the_whole_expert_and_join_back(kind):
    whole = moe_layer(D, H, E, K, seed=3, activation=kind).experts
    shards = [moe_layer(D, H, E, K, ep_size=2, ep_rank=s, seed=3, activation=kind, etp_size=2).experts
              for s in range(2)]
    expert = expert_kind(kind)
    for s, shard in enumerate(shards):
        assert shard.w_in.shape[1] == whole.w_in.shape[1] // 2 and shard.output_scale == whole.output_scale
        for e in range(E):
            assert torch.equal(shard.w_in[e], expert.hidden_slice(whole.w_in[e], s, 2))
            assert torch.equal(shard.w_out[e], whole.w_out[e, s * H // 2:(s + 1) * H // 2])
    assert torch.equal(expert.join_hidden([shard.w_in.detach() for shard in shards]), whole.w_in.detach())


class _SentNoise:
    """GlobalTokenNoise without `rows`: the router draws the secondary noise on the tokens' ranks and sends it,
    the numbers keyed rows would give (so one process with keyed noise is the reference)."""

    def __init__(self, keyed: GlobalTokenNoise):
        self.keyed = keyed

    def __call__(self, n: int, e: int, device) -> torch.Tensor:
        return self.keyed(n, e, device)


def _hierarchical_router() -> HierarchicalRouter:
    return randomized(HierarchicalRouter(D, 2, E // 2, k_primary=2, k_secondary=1).double())


def _layer(world, rank, case, shards):
    kind = "swiglu" if case == "swiglu" else "relu"
    if case.startswith("hier"):
        layer = hierarchical_layer(D, H, E, K, ep_size=world, ep_rank=rank, seed=3, activation=kind,
                                   etp_size=shards, router=_hierarchical_router(), **CASES[case]).double()
    else:
        layer = moe_layer(D, H, E, K, ep_size=world, ep_rank=rank, seed=3, activation=kind, etp_size=shards,
                          **CASES[case]).double()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            layer.router.w_gate.copy_(torch.randn(D, E, generator=gen, dtype=torch.float64))
    layer.train(case in NOISY)
    if case in NOISY:
        noise = GlobalTokenNoise(seed=7, layer_index=0, rank=rank, world_size=world)
        layer.router.noise_sampler = _SentNoise(noise) if case == "hier_sent" and world > 1 else noise
    return layer


def _batch(world):
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(world * N, D, generator=gen, dtype=torch.float64),
            torch.randn(world * N, D, generator=gen, dtype=torch.float64))


def _run(layer, x, upstream, ranks=1, aux_weight=1.0, padded=False):
    """Forward and backward; each of `ranks` ranks carries 1/ranks of the (global) aux loss. `padded`: the last 3
    rows of each rank's N are padding."""
    x = x.clone().requires_grad_(True)
    real_N = (torch.arange(x.shape[0]) % N < N - 3) if padded else None
    with real_tokens([layer], real_N):
        y, aux = layer(x)
    ((y * upstream).sum() + aux * aux_weight / ranks).backward()
    return {"y": y.detach(), "x_grad": x.grad, "grads": {n: p.grad for n, p in layer.named_parameters()},
            "routed": layer.stats.routed_E}


def _reference(case, world):
    """One process with whole experts. Capacity is per sending rank (GShard's): there each rank's tokens go
    through it on their own, the weights' gradients summed, and the loss without the aux loss (a rank's own
    batch would give another one)."""
    x_all, up_all = _batch(world)
    single = _layer(1, 0, case, 1)
    padded = case in PADDED
    if "capacity" not in case:
        return single, _run(single, x_all, up_all, padded=padded)
    parts = [_run(single, x_all[r * N:(r + 1) * N], up_all[r * N:(r + 1) * N], aux_weight=0.0, padded=padded)
             for r in range(world)]
    return single, {"y": torch.cat([p["y"] for p in parts]), "x_grad": torch.cat([p["x_grad"] for p in parts]),
                    "grads": parts[-1]["grads"],   # (accumulated over the ranks' backward passes)
                    "routed": sum(p["routed"] for p in parts)}


def _worker(rank, world, shards):
    x_all, up_all = _batch(world)
    mine = slice(rank * N, (rank + 1) * N)
    got = {}
    for case in CASES:
        layer = _layer(world, rank, case, shards)
        layer.set_deepspeed_parallelism()
        aux_weight = 0.0 if "capacity" in case else 1.0
        got[case] = {**_run(layer, x_all[mine], up_all[mine], world, aux_weight, case in PADDED),
                     "rank": (layer.expert_rank, layer.hidden_shard),
                     "copies": {n for n, p in layer.named_parameters() if getattr(p, "ds_pipe_replicated", False)}}
    return got


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4], ids=["ep1xetp2", "ep2xetp2"])
def test_expert_tensor_parallel_ranks_equal_one_process(world):
    results = run_ranks(_worker, world_size=world, args=(2,), deepspeed=True, timeout=120)
    secondary = ("router.w_gate_secondary", "router.w_noise_secondary")
    for case in CASES:
        single, want = _reference(case, world)
        kind = single.experts.kind
        local = E // (world // 2)
        for rank, got in enumerate(results):
            got, where = got[case], f"{case}, rank {rank}"
            mine = slice(rank * N, (rank + 1) * N)
            torch.testing.assert_close(got["y"], want["y"][mine], msg=lambda m: f"{where}: {m}")
            torch.testing.assert_close(got["x_grad"], want["x_grad"][mine], msg=lambda m: f"{where}: {m}")
            expert_rank, shard = got["rank"]
            experts = range(expert_rank * local, (expert_rank + 1) * local)
            w_in = torch.stack([kind.hidden_slice(want["grads"]["experts.w_in"][e], shard, 2) for e in experts])
            w_out = want["grads"]["experts.w_out"][experts.start:experts.stop, shard * H // 2:(shard + 1) * H // 2]
            torch.testing.assert_close(got["grads"]["experts.w_in"], w_in, msg=lambda m: f"{where} w_in: {m}")
            torch.testing.assert_close(got["grads"]["experts.w_out"], w_out, msg=lambda m: f"{where} w_out: {m}")
            if case.startswith("hier"):   # each copy of its groups' secondary gates has the whole gradient
                groups = slice(expert_rank * local // 2, (expert_rank + 1) * local // 2)
                for name in secondary[:1] + secondary[1:] * (case in NOISY):
                    torch.testing.assert_close(got["grads"][name], want["grads"][name][groups],
                                               msg=lambda m, name=name: f"{where} {name}: {m}")
                assert got["copies"] == (set(secondary) if shard else set()), where   # the norm counts one copy
        for name in ("router.w_gate_primary", "router.w_noise_primary") if case in NOISY else \
                ("router.w_gate_primary",) if case.startswith("hier") else ("router.w_gate",):
            router = sum(got[case]["grads"][name] for got in results)   # data-parallel: the ranks' sum
            torch.testing.assert_close(router, want["grads"][name], msg=lambda m, name=name: f"{case} {name}: {m}")
        routed = sum(got[case]["routed"] for got in results)   # each real pair counted once, not once per shard
        torch.testing.assert_close(routed, want["routed"], msg=lambda m: f"{case} routed pairs: {m}")
        if case == "hier_keys":   # dropless: k pairs per real token
            assert routed.sum() == world * (N - 3) * K


def test_saved_shards_join_into_whole_experts_and_cut_anew(tmp_path):
    """The portable state of an --etp-size 2 checkpoint (2 expert-parallel ranks x 2 shards, SwiGLU) read for
    another layout: the whole experts' weights and moments, and any shard of them, each exactly; the hierarchical
    gate's secondary gates, copied beside each shard, whole for any layout."""
    from moe_scale.train.reshard import _ExpertFiles, _HiddenUnits, _Split

    kind = expert_kind("swiglu")
    whole = torch.randn(E, 2 * H, D, generator=torch.Generator().manual_seed(0))   # gate rows, then up rows
    hidden = _HiddenUnits(kind, first_layer=True)
    gates = torch.randn(E // 2, D, 2, generator=torch.Generator().manual_seed(1))   # 2 groups' secondary gates
    for rank in range(2):
        for shard in range(2):
            part = hidden.slice(whole[rank * 2:(rank + 1) * 2], shard, 2)
            torch.save({"experts.w_in": {"first": rank * 2, "total": E,
                                         "state": {"param": part, "exp_avg": 2 * part, "step": 3}},
                        "router.w_gate_secondary": {"first": rank, "total": E // 2,   # a copy beside each shard
                                                    "state": {"param": gates[rank:rank + 1], "step": 3}}},
                       tmp_path / f"experts_ep{rank}_etp{shard}of2.pt")
    files = _ExpertFiles(tmp_path)
    got = files.shard_of("experts.w_in", _Split(1, 2, E, "x", "g", 0, 1, hidden))   # experts 1 and 2, whole
    assert torch.equal(got["param"], whole[1:3]) and torch.equal(got["exp_avg"], 2 * whole[1:3]) and got["step"] == 3
    for shards in (2, 4):   # cut anew: into as many shards as saved, and into more
        for shard in range(shards):
            got = files.shard_of("experts.w_in", _Split(0, E, E, "x", "g", shard, shards, hidden))["param"]
            assert torch.equal(got, torch.stack([kind.hidden_slice(whole[e], shard, shards) for e in range(E)]))
    for shard, shards in ((0, 1), (0, 2), (1, 2)):   # the copies: whole, into any layout
        got = files.shard_of("router.w_gate_secondary", _Split(0, E // 2, E // 2, "x", "g", shard, shards))
        assert torch.equal(got["param"], gates) and got["step"] == 3
