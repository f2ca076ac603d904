import math

import pytest
import torch
import torch.nn.functional as F

from moe_scale.moe.losses import cv_squared
from moe_scale.moe.router import GlobalTokenNoise, NoisyTopKRouter, prob_in_top_k
from tests.moe.router.collectives import SumWith
from tests.moe.router.reference import noisy_logits

STD_AT_ZERO_INIT = math.log(2.0) + 0.01  # softplus(0) + noise_epsilon = 0.703147


def make_router(d=8, e=6, k=2, seed=0, scale=0.4, **kw):
    router = NoisyTopKRouter(d, e, k, **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.w_gate.copy_(torch.randn(d, e, generator=gen) * scale)
        router.w_noise.copy_(torch.randn(d, e, generator=gen) * scale)
    return router


def fixed_noise(noise_NE):
    return lambda n, e, device: noise_NE[:n, :e].to(device)


def reference_gates(router, x_ND, noise_NE=None):
    """Straight transcription of spec §1.2 with torch.topk + softmax."""
    x = x_ND.double()
    logits = x @ router.w_gate.double()
    if noise_NE is not None:
        std = F.softplus(x @ router.w_noise.double()) + 1e-2
        logits = logits + noise_NE.double() * std
    vals, idx = logits.topk(router.k, dim=1)
    return torch.softmax(vals, dim=1), idx


def sort_by_expert(gates_NK, experts_NK):
    order = experts_NK.argsort(dim=1)
    return gates_NK.gather(1, order), experts_NK.gather(1, order)


# ---------------------------------------------------------------- construction


def test_zero_init_no_bias_and_checkpoint_safe_names():
    router = NoisyTopKRouter(16, 8, 2)
    names = dict(router.named_parameters())
    assert set(names) == {"w_gate", "w_noise"}
    assert all("expert" not in n for n in names)
    assert names["w_gate"].shape == names["w_noise"].shape == (16, 8)
    assert all(torch.count_nonzero(p) == 0 for p in names.values())


@pytest.mark.parametrize("k", [0, 7])
def test_invalid_k_raises(k):
    with pytest.raises(ValueError, match="top-k"):
        NoisyTopKRouter(8, 6, k)


# ---------------------------------------------------------------- zero init


def test_zero_init_std_and_gates_through_forward():
    router = NoisyTopKRouter(8, 6, 2).train()
    x = torch.randn(50, 8)
    noise = torch.randn(50, 6)
    router.noise_sampler = fixed_noise(noise)
    _, _, std = noisy_logits(router, x, noise)
    torch.testing.assert_close(std, torch.full_like(std, 0.703147), atol=1e-6, rtol=0)
    out = router(x)
    vals, idx = noise.topk(2, dim=1)  # a positive constant std keeps the noise order
    torch.testing.assert_close(out.experts_NK, idx)
    torch.testing.assert_close(out.gates_NK, torch.softmax(vals * STD_AT_ZERO_INIT, dim=1))


def test_zero_init_load_is_balanced():
    torch.manual_seed(0)
    n, e, k = 20000, 8, 2
    router = NoisyTopKRouter(4, e, k).train()
    out = router(torch.randn(n, 4))
    assert out.gates_NK.dtype == torch.float32 and out.experts_NK.dtype == torch.int64
    torch.testing.assert_close(out.gates_NK.sum(1), torch.ones(n))
    assert all(len(set(row)) == k for row in out.experts_NK.tolist())
    expected = n * k / e  # 5000; binomial std ~ 61
    hard_E = torch.bincount(out.experts_NK.flatten(), minlength=e).float()
    assert (hard_E - expected).abs().max() < 0.05 * expected
    # E[P(x,i)] = P(i in top k) = k/E, so the smooth load is balanced too
    assert (out.load_E.detach() - expected).abs().max() < 0.05 * expected
    assert out.importance_E.sum().item() == pytest.approx(n, rel=1e-5)


# ---------------------------------------------------------------- gates, importance, load


def test_training_gates_are_softmax_over_kept_noisy_logits():
    router = make_router(e=6, k=3).train()
    x, noise = torch.randn(40, 8), torch.randn(40, 6)
    router.noise_sampler = fixed_noise(noise)
    out = router(x)
    ref_g, ref_i = reference_gates(router, x, noise)
    g, i = sort_by_expert(out.gates_NK, out.experts_NK)
    rg, ri = sort_by_expert(ref_g.float(), ref_i)
    torch.testing.assert_close(i, ri)
    torch.testing.assert_close(g, rg)
    # and not the clean-logit gates
    clean_g, _ = reference_gates(router, x)
    assert not torch.allclose(out.gates_NK.double().sort(1).values, clean_g.sort(1).values, atol=1e-3)


def test_eval_gates_use_clean_logits_and_load_is_hard_count():
    router = make_router(e=6, k=2).eval()
    router.noise_sampler = lambda *a: pytest.fail("no noise at eval")
    x = torch.randn(40, 8)
    out, again = router(x), router(x)
    torch.testing.assert_close(out.gates_NK, again.gates_NK)  # deterministic
    ref_g, ref_i = reference_gates(router, x)
    torch.testing.assert_close(out.experts_NK, ref_i)
    torch.testing.assert_close(out.gates_NK, ref_g.float())
    torch.testing.assert_close(out.load_E, torch.bincount(ref_i.flatten(), minlength=6).float())


def test_noisy_false_in_training_is_deterministic_hard_count():
    router = make_router(e=6, k=2, noisy=False).train()
    x = torch.randn(30, 8)
    out = router(x)
    ref_g, ref_i = reference_gates(router, x)
    torch.testing.assert_close(out.gates_NK, ref_g.float())
    torch.testing.assert_close(out.load_E, torch.bincount(ref_i.flatten(), minlength=6).float())


def test_importance_is_sum_of_dense_gates_and_aux_loss_formula():
    router = make_router(e=6, k=2, w_importance=0.3, w_load=0.7).train()
    out = router(torch.randn(32, 8))
    dense_NE = torch.zeros(32, 6).scatter(1, out.experts_NK, out.gates_NK)
    torch.testing.assert_close(out.importance_E, dense_NE.sum(0))
    expected = 0.3 * cv_squared(out.importance_E) + 0.7 * cv_squared(out.load_E)
    torch.testing.assert_close(out.aux_loss, expected)


def test_smooth_load_is_kth_of_the_others_estimator():
    """load_E == Σ_n Φ((clean - k-th largest noisy logit among the OTHER experts) / std), spec eq. 8-10."""
    e, k = 6, 2
    router = make_router(e=e, k=k).train()
    x, noise = torch.randn(20, 8), torch.randn(20, e)
    router.noise_sampler = fixed_noise(noise)
    out = router(x)
    clean, noisy, std = (t.detach().double() for t in noisy_logits(router, x, noise))
    expected = torch.zeros(e, dtype=torch.float64)
    for i in range(e):
        others = torch.cat([noisy[:, :i], noisy[:, i + 1 :]], dim=1)
        thr = others.topk(k, dim=1).values[:, k - 1]
        expected[i] = (0.5 * (1 + torch.erf((clean[:, i] - thr) / (math.sqrt(2) * std[:, i])))).sum()
    torch.testing.assert_close(out.load_E.detach().double(), expected, rtol=1e-5, atol=1e-5)


def test_prob_in_top_k_matches_monte_carlo():
    """Freeze every coordinate's noise but one, resample that one: frequency of 'in the top k' == P(x, i)."""
    e, k, n, samples = 6, 2, 4, 20000
    router = make_router(e=e, k=k, seed=3, scale=0.3).train()
    gen = torch.Generator().manual_seed(1)
    x, noise = torch.randn(n, 8, generator=gen), torch.randn(n, e, generator=gen)
    router.noise_sampler = fixed_noise(noise)
    with torch.no_grad():
        clean, noisy, std = noisy_logits(router, x, noise)
        top = noisy.topk(k + 1, dim=1).values
        p_NE = prob_in_top_k(clean, noisy, std, top, k)
    z_S = torch.randn(samples, generator=gen)
    checked_in = checked_out = 0
    for t in range(n):
        in_top = set(noisy[t].topk(k).indices.tolist())
        for i in range(e):
            resampled_S = clean[t, i] + z_S * std[t, i]
            others = torch.cat([noisy[t, :i], noisy[t, i + 1 :]])
            beaten_by_S = (others[None, :] > resampled_S[:, None]).sum(1)
            freq = (beaten_by_S < k).float().mean().item()
            assert abs(freq - p_NE[t, i].item()) < 0.015, (t, i, freq, p_NE[t, i].item())
            if 0.05 < freq < 0.95:
                checked_in += i in in_top
                checked_out += i not in in_top
    assert checked_in >= 2 and checked_out >= 2  # the test exercised both thresholds


def test_prob_in_top_k_is_a_step_at_zero_std():
    clean = torch.tensor([[3.0, 1.0, 2.0]])
    top = clean.topk(2, dim=1).values
    p = prob_in_top_k(clean, clean, torch.zeros_like(clean), top, 1)
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- gradients


def test_load_loss_alone_trains_both_gating_matrices():
    router = make_router(e=6, k=2, w_importance=0.0, w_load=1.0).train()
    router(torch.randn(64, 8)).aux_loss.backward()
    assert router.w_gate.grad.abs().sum() > 0
    assert router.w_noise.grad.abs().sum() > 0


def test_aux_loss_gradient_matches_finite_differences():
    """Catches a detached threshold: finite differences see the thresholds move, a detached graph would not."""
    router = make_router(d=4, e=5, k=2, w_importance=0.5, w_load=1.0).double().train()
    x, noise = torch.randn(12, 4, dtype=torch.float64), torch.randn(12, 5, dtype=torch.float64)
    router.noise_sampler = fixed_noise(noise)

    def aux(w_gate, w_noise):  # the module's own forward, with the parameters swapped in
        return torch.func.functional_call(router, {"w_gate": w_gate, "w_noise": w_noise}, (x,)).aux_loss

    params = (router.w_gate.detach().clone().requires_grad_(), router.w_noise.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(aux, params, eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("e", [8, 64])
def test_gate_and_noise_logits_as_one_product_equal_two(e, monkeypatch):
    """With few experts x multiplies w_gate and w_noise side by side in one product: same gates, experts,
    aux loss and gradients as the two products apart (forced either way at both sizes)."""
    from moe_scale.moe.router import noisy_topk as routers

    x, noise, y_E = torch.randn(40, 8), torch.randn(40, e), torch.randn(e)
    results = []
    for fused_max in (0, 10_000):
        monkeypatch.setattr(routers, "_FUSED_GATE_MAX_EXPERTS", fused_max)
        router = make_router(e=e, k=2).train()
        router.noise_sampler = fixed_noise(noise)
        out = router(x)
        (task_loss(out, y_E) + out.aux_loss).backward()
        results.append((out.gates_NK, out.experts_NK, out.aux_loss, router.w_gate.grad, router.w_noise.grad))
    for apart, together in zip(*results):
        torch.testing.assert_close(together, apart, rtol=1e-6, atol=1e-6)


def task_loss(out, y_E):
    """Σ_n Σ_k gate · y[expert]: what a combine of scalar expert outputs gives."""
    return (out.gates_NK * y_E[out.experts_NK]).sum()


def test_k1_task_loss_gives_gate_no_gradient_but_k2_does():
    x, y_E = torch.randn(32, 8), torch.randn(6)
    r1 = make_router(e=6, k=1).train()
    task_loss(r1(x), y_E).backward()
    assert r1.w_gate.grad is None or torch.count_nonzero(r1.w_gate.grad) == 0
    r2 = make_router(e=6, k=2).train()
    task_loss(r2(x), y_E).backward()
    assert r2.w_gate.grad.abs().sum() > 0
    assert r2.w_noise.grad.abs().sum() > 0  # through the noisy logits in the gates


# ---------------------------------------------------------------- data-parallel sums


def test_identical_ranks_leave_cv2_unchanged():
    x, noise = torch.randn(40, 8), torch.randn(40, 6)
    single, doubled = make_router().train(), make_router().train()
    for r in (single, doubled):
        r.noise_sampler = fixed_noise(noise)
    doubled.connect(SumWith(lambda t: t * 2))
    a, b = single(x), doubled(x)
    torch.testing.assert_close(b.importance_E, 2 * a.importance_E)
    torch.testing.assert_close(b.load_E, 2 * a.load_E)
    torch.testing.assert_close(a.aux_loss, b.aux_loss)


def test_two_shards_equal_concatenated_batch_in_eval():
    router = make_router().eval()
    x_a, x_b = torch.randn(30, 8), torch.randn(18, 8)
    full = router(torch.cat([x_a, x_b]))
    b = router(x_b)
    other_2E = torch.stack([b.importance_E, b.load_E]).detach()
    router.connect(SumWith(lambda t: t + other_2E))  # what an all-reduce on rank A returns
    a = router(x_a)
    torch.testing.assert_close(a.importance_E, full.importance_E)
    torch.testing.assert_close(a.load_E, full.load_E)
    torch.testing.assert_close(a.aux_loss, full.aux_loss)
    router.connect(SumWith(lambda t: t))
    assert router(x_a).aux_loss.item() != pytest.approx(full.aux_loss.item())  # the sum mattered


def test_two_ranks_with_global_token_noise_equal_one_rank_in_training():
    n_local, e = 16, 6
    x = torch.randn(2 * n_local, 8)
    one = make_router(e=e).train()
    one.noise_sampler = GlobalTokenNoise(seed=5, layer_index=1, rank=0, world_size=1)
    full = one(x)
    shards = []
    for rank in range(2):
        r = make_router(e=e).train()
        r.noise_sampler = GlobalTokenNoise(seed=5, layer_index=1, rank=rank, world_size=2)
        shards.append(r(x[rank * n_local : (rank + 1) * n_local]))
    torch.testing.assert_close(torch.cat([s.gates_NK for s in shards]), full.gates_NK)
    torch.testing.assert_close(torch.cat([s.experts_NK for s in shards]), full.experts_NK)
    torch.testing.assert_close(shards[0].load_E + shards[1].load_E, full.load_E)
    torch.testing.assert_close(shards[0].importance_E + shards[1].importance_E, full.importance_E)


def test_batch_sum_is_called_once_even_without_tokens():
    router = make_router().train()
    calls = []
    router.connect(SumWith(lambda t: calls.append(t.shape) or t))
    out = router(torch.randn(0, 8))
    assert calls == [(2, 6)]
    assert torch.isfinite(out.aux_loss) and out.gates_NK.shape == (0, 2)


# ---------------------------------------------------------------- GlobalTokenNoise


def test_global_token_noise_slices_concatenate():
    whole = GlobalTokenNoise(seed=7, layer_index=2, rank=0, world_size=1)
    r0 = GlobalTokenNoise(seed=7, layer_index=2, rank=0, world_size=2)
    r1 = GlobalTokenNoise(seed=7, layer_index=2, rank=1, world_size=2)
    for g in (whole, r0, r1):
        g.set_step(3)
    full = whole(10, 4, torch.device("cpu"))
    assert full.shape == (10, 4)
    torch.testing.assert_close(torch.cat([r0(5, 4, "cpu"), r1(5, 4, "cpu")]), full)


def test_global_token_noise_depends_on_step_layer_and_micro_step():
    g = GlobalTokenNoise(seed=7, layer_index=0, rank=0, world_size=1)
    g.set_step(1)
    a, a_micro2 = g(6, 3, "cpu"), g(6, 3, "cpu")
    g.set_step(1)
    torch.testing.assert_close(g(6, 3, "cpu"), a)  # same step, same noise
    assert not torch.allclose(a, a_micro2)  # next gradient-accumulation micro-step differs
    g.set_step(2)
    assert not torch.allclose(g(6, 3, "cpu"), a)
    other_layer = GlobalTokenNoise(seed=7, layer_index=1, rank=0, world_size=1)
    other_layer.set_step(1)
    assert not torch.allclose(other_layer(6, 3, "cpu"), a)


# ---------------------------------------------------------------- edge cases and precision


def test_k_equal_to_num_experts_falls_back_to_hard_count():
    router = make_router(e=4, k=4).train()
    out = router(torch.randn(10, 8))
    torch.testing.assert_close(out.load_E, torch.full((4,), 10.0))
    assert sorted(out.experts_NK[0].tolist()) == [0, 1, 2, 3]
    torch.testing.assert_close(out.gates_NK.sum(1), torch.ones(10))
    assert out.aux_loss.item() >= 0


def test_half_precision_input_under_autocast_computes_in_float32():
    router = make_router().train()
    x = torch.randn(20, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x)
    assert out.gates_NK.dtype == torch.float32
    assert out.importance_E.dtype == out.load_E.dtype == out.aux_loss.dtype == torch.float32


def test_noiseless_router_does_not_start_tied():
    torch.manual_seed(0)
    router = NoisyTopKRouter(16, 8, 2, noisy=False)
    out = router(torch.randn(256, 16))
    # zero init without noise would send every token to the same two experts
    assert torch.unique(out.experts_NK).numel() == 8
    assert NoisyTopKRouter(16, 8, 2).w_gate.abs().sum() == 0      # the noisy gate keeps the paper's zero init
