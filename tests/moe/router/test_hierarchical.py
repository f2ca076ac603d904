import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from moe_scale.moe.router.hierarchical import HierarchicalRouter
from moe_scale.moe.losses import cv_squared
from moe_scale.moe.router import GlobalTokenNoise, NoisyTopKRouter
from tests.multiproc import run_ranks
from tests.moe.router.collectives import SumWith

STD_AT_ZERO_INIT = math.log(2.0) + 0.01  # softplus(0) + noise_epsilon = 0.703147
WEIGHTS = ("w_gate_primary", "w_noise_primary", "w_gate_secondary", "w_noise_secondary")


def make_router(d=8, a=4, b=3, kp=2, ks=2, seed=0, scale=0.5, dtype=torch.float32, **kw):
    router = HierarchicalRouter(d, a, b, k_primary=kp, k_secondary=ks, **kw).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in WEIGHTS:
            p = getattr(router, name)
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale)
    return router


class RecordedNoise:
    """Hands out fixed noise tensors in call order (as the requested shape) and records the requested shapes."""

    def __init__(self, *noises):
        self.noises, self.calls = list(noises), []

    def __call__(self, n, e, device):
        self.calls.append((n, e))
        return self.noises[len(self.calls) - 1].reshape(n, e).to(device)


def by_group(noise_NKpG, groups_NKp):
    """Noise of each token's picked groups [N, Kp*G] (row t: its groups in the primary's top-k order) as the
    router draws it: one row per (token, group) pair, the pairs sorted by group (stable) [N*Kp, G]."""
    rows = noise_NKpG.reshape(groups_NKp.numel(), -1)
    return rows[torch.argsort(groups_NKp.reshape(-1), stable=True)]


def picked_noise(router, x, noise_p, noise_full):
    """The router's secondary noise (N*Kp, G) from noise for every (token, group, expert) (N, A*G): the rows of
    each token's picked groups, sorted by group (the references index the full noise)."""
    n, a, b, kp = x.shape[0], router.num_groups, router.experts_per_group, router.k_primary
    with torch.no_grad():
        std = F.softplus(x @ router.w_noise_primary) + router.noise_epsilon
        groups = (x @ router.w_gate_primary + noise_p * std).topk(kp, dim=1).indices
    return by_group(noise_full.reshape(n, a, b).gather(1, groups[..., None].expand(n, kp, b)), groups)


def dense(gates_NK, experts_NK, e):
    return gates_NK.new_zeros(gates_NK.shape[0], e).scatter_add(1, experts_NK, gates_NK)


# ---------------------------------------------------------------- references written from the spec


def flat_reference(x, w_gate, w_noise, noise, k, noisy):
    """Flat noisy top-k (spec §1.2-1.3), with kth_excluding computed literally: dense gates [R, C], load [C]."""
    clean = x @ w_gate
    std = F.softplus(x @ w_noise) + 1e-2
    logits = clean + noise * std if noisy else clean
    r, c = logits.shape
    vals, idx = logits.topk(k, dim=1)
    gates = torch.zeros_like(logits).scatter(1, idx, torch.softmax(vals, dim=1))
    chosen = torch.zeros_like(logits).scatter(1, idx, 1.0)
    if noisy and k < c:
        cols = []
        for col in range(c):  # k-th largest noisy logit among the *other* columns
            others = torch.cat([logits[:, :col], logits[:, col + 1 :]], dim=1)
            thr = others.topk(k, dim=1).values[:, k - 1]
            cols.append(torch.distributions.Normal(0.0, 1.0).cdf((clean[:, col] - thr) / std[:, col]))
        load = torch.stack(cols, dim=1).sum(0)
    else:
        load = chosen.sum(0)
    return gates, chosen, load


def loop_reference(router, x, noise_p, noise_s, noisy):
    """Spec §1.6, one group at a time: flat top-k_s over X^(i) with group i's weights and the same noise values."""
    a, b = router.num_groups, router.experts_per_group
    gp, chosen_p, load_p = flat_reference(x, router.w_gate_primary, router.w_noise_primary, noise_p,
                                          router.k_primary, noisy)
    cnt_p = chosen_p.sum(0)
    blocks, imp_rows, load_rows = [], [], []
    for i in range(a):
        rows = chosen_p[:, i].nonzero().squeeze(1)
        gs, _, load_i = flat_reference(x[rows], router.w_gate_secondary[i], router.w_noise_secondary[i],
                                       noise_s[rows, i * b : (i + 1) * b], router.k_secondary, noisy)
        block = x.new_zeros(x.shape[0], b).index_add(0, rows, gp[rows, i : i + 1] * gs)
        blocks.append(block)
        imp_rows.append(block.sum(0))
        load_rows.append(load_i)
    importance = torch.stack(imp_rows).reshape(-1)
    load_s = torch.stack(load_rows)
    load_h = (load_p[:, None] * load_s / (cnt_p[:, None] + 1e-10)).reshape(-1)
    aux = router.w_importance * cv_squared(importance) + router.w_load * cv_squared(load_h)
    return torch.cat(blocks, dim=1), importance, load_h, aux


# ---------------------------------------------------------------- construction


def test_parameters_zero_init_shapes_and_checkpoint_safe_names():
    router = HierarchicalRouter(16, 4, 3)
    params = dict(router.named_parameters())
    assert set(params) == set(WEIGHTS)
    assert all("expert" not in name for name in params)
    assert params["w_gate_primary"].shape == params["w_noise_primary"].shape == (16, 4)
    assert params["w_gate_secondary"].shape == params["w_noise_secondary"].shape == (4, 16, 3)
    assert all(torch.count_nonzero(p) == 0 for p in params.values())
    assert router.k == 4 and router.num_experts == 12


@pytest.mark.parametrize("kp, ks, match", [(0, 2, "k_primary"), (5, 2, "k_primary"),
                                           (2, 0, "k_secondary"), (2, 4, "k_secondary")])
def test_invalid_k_raises(kp, ks, match):
    with pytest.raises(ValueError, match=match):
        HierarchicalRouter(8, 4, 3, k_primary=kp, k_secondary=ks)


# ---------------------------------------------------------------- batched == per-group loop


@pytest.mark.parametrize("mode, a, b, kp, ks", [
    ("train", 4, 3, 2, 2),
    ("train", 5, 4, 1, 3),
    ("train", 3, 4, 3, 2),  # k_p == a: primary load is the hard count
    ("train", 4, 2, 2, 2),  # k_s == b: secondary load is the hard count
    ("eval", 4, 3, 2, 2),
    ("noiseless", 4, 3, 2, 2),
])
def test_batched_equals_per_group_loop_incl_gradients(mode, a, b, kp, ks):
    torch.manual_seed(1)
    n, d = 40, 8
    router = make_router(d=d, a=a, b=b, kp=kp, ks=ks, dtype=torch.float64, w_importance=0.3, w_load=0.7)
    router.train(mode != "eval")
    router.noisy = mode != "noiseless"
    noisy = mode == "train"
    x = torch.randn(n, d, dtype=torch.float64)
    noise_p, noise_s = torch.randn(n, a, dtype=torch.float64), torch.randn(n, a * b, dtype=torch.float64)
    router.noise_sampler = RecordedNoise(noise_p, picked_noise(router, x, noise_p, noise_s))
    out = router(x)
    ref_dense, ref_imp, ref_load, ref_aux = loop_reference(router, x, noise_p, noise_s, noisy)

    assert out.gates_NK.dtype == torch.float64 and out.gates_NK.shape == (n, kp * ks)
    got_dense = dense(out.gates_NK, out.experts_NK, a * b)
    torch.testing.assert_close(got_dense, ref_dense)
    torch.testing.assert_close((got_dense > 0), (ref_dense > 0))
    torch.testing.assert_close(out.importance_E, ref_imp)
    torch.testing.assert_close(out.load_E, ref_load)
    torch.testing.assert_close(out.aux_loss, ref_aux)
    assert router.noise_sampler.calls == ([(n, a), (n * kp, b)] if noisy else [])

    # gradients of a task-like loss on the gates plus the balancing loss, to all four matrices
    probe = torch.randn(n, a * b, dtype=torch.float64)
    params = [getattr(router, name) for name in WEIGHTS]
    got = torch.autograd.grad((got_dense * probe).sum() + out.aux_loss, params, allow_unused=True)
    ref = torch.autograd.grad((ref_dense * probe).sum() + ref_aux, params, allow_unused=True)
    for name, g, r in zip(WEIGHTS, got, ref):
        if r is None:
            assert g is None or torch.count_nonzero(g) == 0, name
        else:
            torch.testing.assert_close(g, r, msg=lambda m, name=name: f"{name}: {m}")


def test_eq14_against_flat_routers():
    """Load_H = load_s row-scaled by load_p / |X^(i)|, with load_p and load_s from the flat router itself."""
    torch.manual_seed(2)
    n, d, a, b = 60, 8, 4, 5
    router = make_router(d=d, a=a, b=b, kp=2, ks=2).train()
    x, noise_p, noise_s = torch.randn(n, d), torch.randn(n, a), torch.randn(n, a * b)
    router.noise_sampler = RecordedNoise(noise_p, picked_noise(router, x, noise_p, noise_s))
    out = router(x)

    primary = NoisyTopKRouter(d, a, 2).train()
    with torch.no_grad():
        primary.w_gate.copy_(router.w_gate_primary)
        primary.w_noise.copy_(router.w_noise_primary)
    primary.noise_sampler = RecordedNoise(noise_p)
    p_out = primary(x)
    cnt_p = torch.bincount(p_out.experts_NK.reshape(-1), minlength=a).float()
    load_s = []
    for i in range(a):
        rows = (p_out.experts_NK == i).any(1).nonzero().squeeze(1)
        secondary = NoisyTopKRouter(d, b, 2).train()
        with torch.no_grad():
            secondary.w_gate.copy_(router.w_gate_secondary[i])
            secondary.w_noise.copy_(router.w_noise_secondary[i])
        secondary.noise_sampler = RecordedNoise(noise_s[rows, i * b : (i + 1) * b])
        load_s.append(secondary(x[rows]).load_E)
    expected = p_out.load_E[:, None] / cnt_p[:, None] * torch.stack(load_s)
    torch.testing.assert_close(out.load_E.detach(), expected.reshape(-1).detach())
    torch.testing.assert_close(out.experts_NK[:, ::2] // b, p_out.experts_NK)  # primary picks, in order


def test_each_token_gets_kp_times_ks_distinct_experts_gates_sum_to_one_importance_sums_to_n():
    torch.manual_seed(3)
    n, a, b, kp, ks = 50, 5, 4, 2, 3
    router = make_router(a=a, b=b, kp=kp, ks=ks).train()
    out = router(torch.randn(n, 8))
    assert out.experts_NK.dtype == torch.int64 and out.experts_NK.shape == (n, kp * ks)
    assert all(len(set(row.tolist())) == kp * ks for row in out.experts_NK)
    assert all(len(set((row // b).tolist())) == kp for row in out.experts_NK)  # k_s experts in each of k_p groups
    assert int(out.experts_NK.min()) >= 0 and int(out.experts_NK.max()) < a * b
    assert bool((out.gates_NK > 0).all())
    torch.testing.assert_close(out.gates_NK.sum(1), torch.ones(n))
    torch.testing.assert_close(out.importance_E.sum(), torch.tensor(float(n)))
    token_C, expert_C, gate_C = out.pairs()
    assert token_C.shape == expert_C.shape == gate_C.shape == (n * kp * ks,)


# ---------------------------------------------------------------- zero init, eval, gradients


def test_zero_init_std_at_both_levels():
    n, a, b = 30, 4, 3
    router = HierarchicalRouter(8, a, b).train()
    noise_p, noise_s = torch.randn(n, a), torch.randn(n, 2 * b)
    vp, groups = noise_p.topk(2, dim=1)  # zero logits: noise times a constant std keeps the noise order
    router.noise_sampler = RecordedNoise(noise_p, by_group(noise_s, groups))
    out = router(torch.randn(n, 8))
    gp = torch.softmax(vp * STD_AT_ZERO_INIT, dim=1)
    sec = noise_s.reshape(n, 2, b)   # the picked groups' noise, in the primary's order
    vs, local = sec.topk(2, dim=2)
    gs = torch.softmax(vs * STD_AT_ZERO_INIT, dim=2)
    torch.testing.assert_close(out.gates_NK, (gp[..., None] * gs).reshape(n, 4))
    torch.testing.assert_close(out.experts_NK, (groups[..., None] * b + local).reshape(n, 4))


def test_zero_init_expected_load_is_balanced():
    torch.manual_seed(4)
    n, a, b = 20000, 4, 4   # Monte Carlo: about 1,250 gates per expert, a relative spread of about 2%
    router = HierarchicalRouter(8, a, b).train()
    out = router(torch.randn(n, 8))
    expected = n * 4 / (a * b)
    torch.testing.assert_close(out.load_E, torch.full((a * b,), expected), rtol=0.06, atol=0)
    torch.testing.assert_close(out.importance_E, torch.full((a * b,), n / (a * b)), rtol=0.06, atol=0)


def test_eval_is_deterministic_noise_free_with_hard_counts():
    router = make_router().eval()

    def no_noise(*_):
        raise AssertionError("eval must not draw noise")

    router.noise_sampler = no_noise
    x = torch.randn(40, 8)
    first, second = router(x), router(x)
    torch.testing.assert_close(first.gates_NK, second.gates_NK)
    torch.testing.assert_close(first.experts_NK, second.experts_NK)
    counts = torch.bincount(first.experts_NK.reshape(-1), minlength=12).float()
    torch.testing.assert_close(first.load_E, counts)  # eq. 14 with hard counts: cnt_p * cnt_s / cnt_p
    params = [getattr(router, name) for name in WEIGHTS]
    grads = torch.autograd.grad(cv_squared(first.load_E), params, allow_unused=True)
    assert all(g is None or torch.count_nonzero(g) == 0 for g in grads)  # a count has no gradient


def test_load_loss_alone_trains_all_four_matrices():
    router = make_router(w_importance=0.0, w_load=1.0).train()
    router(torch.randn(64, 8)).aux_loss.backward()
    for name in WEIGHTS:
        grad = getattr(router, name).grad
        assert grad is not None and torch.count_nonzero(grad) > 0, name


def test_batch_sum_called_once_on_concatenation_even_without_tokens():
    a, b = 4, 3
    router = make_router(a=a, b=b).train()
    calls = []
    router.connect(SumWith(lambda t: calls.append(t.shape) or t))
    noise = RecordedNoise(torch.randn(0, a), torch.randn(0, 2 * b))
    router.noise_sampler = noise
    out = router(torch.randn(0, 8))
    assert calls == [(2 * a * b + 2 * a,)]
    assert noise.calls == [(0, a), (0, b)]
    assert torch.isfinite(out.aux_loss) and out.gates_NK.shape == (0, 4)


def test_half_precision_under_autocast_computes_in_float32():
    router = make_router().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(torch.randn(20, 8, dtype=torch.bfloat16))
    assert out.gates_NK.dtype == out.importance_E.dtype == out.load_E.dtype == torch.float32


# ---------------------------------------------------------------- data parallel: 2 ranks == 1 process


N_LOCAL, D, A, B = 12, 8, 4, 3


def _route(rank, world, x_ND, all_reduce):
    router = make_router(d=D, a=A, b=B, seed=11).train()
    router.noise_sampler = GlobalTokenNoise(seed=3, layer_index=0, rank=rank, world_size=world)
    router.noise_sampler.set_step(7)
    if all_reduce:
        import torch.distributed as dist

        from moe_scale.distributed.comm import BatchCollectives

        router.connect(BatchCollectives(dist.group.WORLD))
    out = router(x_ND)
    out.aux_loss.backward()
    grads = {name: getattr(router, name).grad.clone() for name in WEIGHTS}
    return {"gates": out.gates_NK.detach(), "experts": out.experts_NK, "importance": out.importance_E.detach(),
            "load": out.load_E.detach(), "aux": out.aux_loss.detach(), "grads": grads}


def _global_batch():
    return torch.randn(2 * N_LOCAL, D, generator=torch.Generator().manual_seed(5))


def _rank_worker(rank, world):
    x = _global_batch()[rank * N_LOCAL : (rank + 1) * N_LOCAL]
    return _route(rank, world, x, all_reduce=True)


def test_eq14_is_formed_from_global_sums_in_process():
    """Rank A's view of a 2-shard batch (the other shard's stats added by a fake all-reduce) == 1 process."""
    full = _route(0, 1, _global_batch(), all_reduce=False)
    x = _global_batch()
    router_b = make_router(d=D, a=A, b=B, seed=11).train()
    router_b.noise_sampler = GlobalTokenNoise(seed=3, layer_index=0, rank=1, world_size=2)
    router_b.noise_sampler.set_step(7)
    stats = []
    router_b.connect(SumWith(lambda t: stats.append(t.detach()) or t))
    router_b(x[N_LOCAL:])
    router_a = make_router(d=D, a=A, b=B, seed=11).train()
    router_a.noise_sampler = GlobalTokenNoise(seed=3, layer_index=0, rank=0, world_size=2)
    router_a.noise_sampler.set_step(7)
    router_a.connect(SumWith(lambda t: t + stats[0]))
    out = router_a(x[:N_LOCAL])
    torch.testing.assert_close(out.load_E, full["load"])
    torch.testing.assert_close(out.aux_loss.detach(), full["aux"])


@pytest.mark.multiprocess
def test_two_ranks_equal_one_process_on_concatenated_batch():
    full = _route(0, 1, _global_batch(), all_reduce=False)
    ranks = run_ranks(_rank_worker, world_size=2)
    for key in ("importance", "load", "aux"):
        for r in ranks:
            torch.testing.assert_close(r[key], full[key])
    torch.testing.assert_close(torch.cat([r["gates"] for r in ranks]), full["gates"])
    torch.testing.assert_close(torch.cat([r["experts"] for r in ranks]), full["experts"])
    for name in WEIGHTS:  # DDP's gradient average of the per-rank gradients == the 1-process gradient
        torch.testing.assert_close((ranks[0]["grads"][name] + ranks[1]["grads"][name]) / 2, full["grads"][name])


@pytest.mark.parametrize("gpu_kernels", [False, True], ids=["native-cpu", "grouped-mm"])
def test_float32_grouped_products_match_float64(gpu_kernels):
    """The secondary logits of the picked groups through the float32 kernels (the native CPU ones, or torch's
    grouped GEMM as on a GPU), forward and every gradient, against the float64 computation."""
    from moe_scale.moe.kernel_policy import gpu_decisions

    torch.manual_seed(6)
    n, d, a, b = 300, 16, 6, 5
    router64 = make_router(d=d, a=a, b=b, kp=2, ks=2, dtype=torch.float64).train()
    router32 = make_router(d=d, a=a, b=b, kp=2, ks=2, dtype=torch.float32).train()
    x = torch.randn(n, d, dtype=torch.float64)
    noise_p, noise_s = torch.randn(n, a, dtype=torch.float64), torch.randn(n, 2 * b, dtype=torch.float64)
    probe = torch.randn(n, a * b, dtype=torch.float64)
    results = []
    for router, dtype in ((router64, torch.float64), (router32, torch.float32)):
        router.noise_sampler = RecordedNoise(noise_p.to(dtype), noise_s.to(dtype))
        with gpu_decisions() if gpu_kernels and dtype == torch.float32 else contextlib.nullcontext():
            out = router(x.to(dtype))
            loss = (dense(out.gates_NK, out.experts_NK, a * b) * probe.to(dtype)).sum() + out.aux_loss
            grads = torch.autograd.grad(loss, [getattr(router, w) for w in WEIGHTS])
        results.append((out.experts_NK, out.gates_NK.double(), [g.double() for g in grads]))
    (experts64, gates64, grads64), (experts32, gates32, grads32) = results
    assert torch.equal(experts64, experts32)
    torch.testing.assert_close(gates32, gates64, rtol=1e-5, atol=1e-6)
    for name, g32, g64 in zip(WEIGHTS, grads32, grads64):
        torch.testing.assert_close(g32, g64, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
