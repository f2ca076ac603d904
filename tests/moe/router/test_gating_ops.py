"""The fused noisy top-k op equals the plain-autograd reference (values and gradients), keeps only three
[N, E] tensors for the backward, and gives the noise logits' gradient to float32 precision at every z."""

import pytest
import torch

from moe_scale.moe.router.gating_ops import noisy_top_k
from moe_scale.moe.router import NoisyTopKRouter, prob_in_top_k
from tests.moe.router.reference import noisy_logits

EPS = 1e-2


def reference(clean, z, noise, k, smooth_load):
    std = torch.nn.functional.softplus(z) + EPS
    noisy = clean + noise * std
    top_values, top_idx = noisy.topk(min(k + 1, clean.shape[1]), dim=1)
    load = prob_in_top_k(clean, noisy, std, top_values, k).sum(0) if smooth_load else clean.new_zeros(clean.shape[1])
    return top_values, top_idx, load


def inputs(n, e, seed):
    gen = torch.Generator().manual_seed(seed)
    clean, z, noise = (torch.randn(n, e, generator=gen, dtype=torch.float64) for _ in range(3))
    return clean.requires_grad_(True), z.mul(2).requires_grad_(True), noise


@pytest.mark.parametrize("n,e,k,spread", [(300, 7, 2, 1), (600, 33, 4, 1), (5, 3, 1, 1), (200, 130, 2, 10)])
def test_values_and_gradients_match_plain_autograd(n, e, k, spread):
    """`spread` scales the logits until Gaussian factors fall below the cutoff that _gaussian sets to 0."""
    clean, z, noise = inputs(n, e, seed=n + e + k)
    clean = clean.detach().mul(spread).requires_grad_(True)
    gen = torch.Generator().manual_seed(1)
    w_top = torch.randn(n, min(k + 1, e), generator=gen, dtype=torch.float64)
    w_load = torch.randn(e, generator=gen, dtype=torch.float64)
    got, want = noisy_top_k(clean, z, noise, EPS, k, True), reference(clean, z, noise, k, True)
    torch.testing.assert_close(got[0], want[0])   # addcmul may round differently from a * b + c
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])
    # Loss through the top values (gates), the thresholds (inside load) and the load itself.
    grads_got = torch.autograd.grad((got[0] * w_top).sum() + (got[2] * w_load).sum(), (clean, z))
    grads_want = torch.autograd.grad((want[0] * w_top).sum() + (want[2] * w_load).sum(), (clean, z))
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_gradcheck_and_no_load_path():
    clean, z, noise = inputs(6, 5, seed=3)
    torch.autograd.gradcheck(lambda c, zz: noisy_top_k(c, zz, noise, EPS, 2, True)[::2], (clean, z))
    # Without the smooth load (k == E or w_load unused) only the top values carry gradient.
    top, _, load = noisy_top_k(clean, z, noise, EPS, 2, False)
    assert torch.equal(load, torch.zeros(5, dtype=torch.float64))
    got = torch.autograd.grad(top.sum(), (clean, z))
    want = torch.autograd.grad(reference(clean, z, noise, 2, False)[0].sum(), (clean, z))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_router_keeps_three_n_by_e_tensors_for_backward():
    """The memory the fused op exists for: ~3 [N, E] float tensors saved (clean, noise, softplus), where plain
    autograd saves about eight. Counted through saved-tensor hooks, so it is exact, not timed."""
    n, e, d = 512, 256, 16
    torch.manual_seed(0)
    router = NoisyTopKRouter(d, e, k=2).train()
    x = torch.randn(n, d)
    nbytes_ne = n * e * 4
    fused = saved_bytes(lambda: router(x))

    noise = torch.randn(n, e)
    router.noise_sampler = lambda n_, e_, device: noise

    def plain():
        clean, noisy, std = noisy_logits(router, x, noise)
        top, _ = noisy.topk(3, dim=1)
        prob_in_top_k(clean, noisy, std, top, 2).sum(0)

    assert fused <= 3.2 * nbytes_ne, fused / nbytes_ne
    assert saved_bytes(plain) >= 6 * nbytes_ne      # the reference really is heavier: the test can fail


def test_router_forward_matches_the_reference_path():
    """NoisyTopKRouter.forward (fused) vs the plain-autograd logits + topk + prob_in_top_k on the same noise."""
    n, e, d, k = 64, 16, 8, 3
    router = NoisyTopKRouter(d, e, k=k).train().double()
    with torch.no_grad():
        router.w_gate.normal_(), router.w_noise.normal_()
    x = torch.randn(n, d, dtype=torch.float64)
    noise = torch.randn(n, e, dtype=torch.float64)
    router.noise_sampler = lambda n_, e_, device: noise
    out = router(x)
    clean, noisy, std = noisy_logits(router, x, noise)
    top, idx = noisy.topk(k + 1, dim=1)
    assert torch.equal(out.experts_NK, idx[:, :k])
    torch.testing.assert_close(out.gates_NK, torch.softmax(top[:, :k], dim=1))
    torch.testing.assert_close(out.load_E, prob_in_top_k(clean, noisy, std, top, k).sum(0))


@pytest.mark.parametrize("n,e,k,spread", [(300, 7, 2, 1), (130, 300, 1, 1), (70, 1030, 4, 1), (5, 3, 2, 1),
                                          (9, 4, 4, 1), (0, 6, 2, 1), (200, 130, 2, 40)])
def test_native_float32_matches_the_float64_reference(n, e, k, spread):
    """CPU float32 runs cpu_gating.c: one pass per row. Against the plain-autograd reference in float64 on
    the same inputs: the same experts, and values, load and both gradients to float32 rounding. Covers
    k + 1 == E, k == E (no load), row block edges (64 rows: n = 70, 130, 300), E past vector widths, and a
    rank with no tokens. `spread` scales the logits past the kernel's clamps (z beyond -60 and 20, Gaussian
    factors below exp(-50)), where the results must not change."""
    from moe_scale.moe.cpu_backend import kernels as cpu_kernels
    if not cpu_kernels.available(torch.empty(0)):
        pytest.skip("native kernels not built")
    smooth = k < e
    clean, z, noise = (t.detach().float().requires_grad_(t.requires_grad) for t in inputs(n, e, seed=n * e + k))
    if spread != 1:
        clean, z = (t.detach().mul(spread).requires_grad_(True) for t in (clean, z))
        std = torch.nn.functional.softplus(z.detach()) + EPS
        assert (z < -60).any() and (z > 20).any() and ((clean.detach() / std) ** 2 > 2 * 50).any()
    gen = torch.Generator().manual_seed(2)
    w_top = torch.randn(n, min(k + 1, e), generator=gen)
    w_load = torch.randn(e, generator=gen)
    got = noisy_top_k(clean, z, noise, EPS, k, smooth)
    want = reference(clean.double(), z.double(), noise.double(), k, smooth)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2].double(), want[2], rtol=1e-5, atol=1e-5 * n ** 0.5)
    grads_got = torch.autograd.grad((got[0] * w_top).sum() + (got[2] * w_load).sum(), (clean, z))
    # The reference ran on clean.double() and z.double(): its gradients reach the float32 leaves too.
    grads_want = torch.autograd.grad((want[0] * w_top.double()).sum() + (want[2] * w_load.double()).sum(), (clean, z))
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_spread_logits_give_no_denormal_gradients(path, monkeypatch):
    """Once a router has learnt, most experts sit far from a token's threshold, and exp(-z^2) of the smooth
    load underflows. Its gradient must hold zeros there, not denormals: the router's matmul backward takes it
    next, and MKL runs about 80x slower on denormal inputs. Both paths, float32."""
    from moe_scale.moe.cpu_backend import kernels as cpu_kernels
    if path == "native" and not cpu_kernels.available(torch.empty(0)):
        pytest.skip("native kernels not built")
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "available", lambda t: False)
    gen = torch.Generator().manual_seed(5)
    clean = (torch.randn(256, 512, generator=gen) * 3).requires_grad_(True)
    z = (torch.randn(256, 512, generator=gen) * 3).requires_grad_(True)
    noise = torch.randn(256, 512, generator=gen)
    top, _, load = noisy_top_k(clean, z, noise, EPS, 2, True)
    w_load = torch.rand(512, generator=gen) * 1e-3
    grads = torch.autograd.grad((top[:, :2].sum(1) * 0.1).sum() + (load * w_load).sum(), (clean, z))
    tiny = torch.finfo(torch.float32).tiny
    for g in grads:
        assert g.abs().gt(0).sum() > g.numel() // 10   # the load's gradient reached most entries
        assert not (g.ne(0) & g.abs().lt(tiny)).any()


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("z_value", [-40.0, -30.0, -20.0, -16.0, -5.0, 0.0, 5.0, 20.0])
def test_float32_noise_gradient_holds_float64_precision_at_the_noise_floor(path, z_value, monkeypatch):
    """d loss / d z (what W_noise's gradient is made of) in float32 against the float64 plain-autograd reference,
    within 1e-5 relative, down to z = -40 where softplus(z) is 4e-16 of eps. Recovering softplus'(z) from
    std - eps cancelled there: a relative error of 1e-3 at z = -16, 0.1 at -20, 1 from -30 on. Through the gates
    (the top values) each entry is compared; through the smooth load, whose Gaussian factors carry float32's
    rounding of (clean - threshold) / std at 1e-5 on their own, the whole gradient's norm."""
    from moe_scale.moe.cpu_backend import kernels as cpu_kernels
    if path == "native" and not cpu_kernels.available(torch.empty(0)):
        pytest.skip("native kernels not built")
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "available", lambda t: False)
    n, e, k = 64, 8, 2
    gen = torch.Generator().manual_seed(0)
    clean = torch.randn(n, e, generator=gen) * 0.01   # near the thresholds at std = eps: the load has a gradient
    noise = torch.randn(n, e, generator=gen)
    w_top, w_load = torch.randn(n, k + 1, generator=gen), torch.randn(e, generator=gen)
    z = torch.full((n, e), z_value, requires_grad=True)

    def grad_z(w_top_scale, w_load_scale):
        top, _, load = noisy_top_k(clean, z, noise, EPS, k, True)
        want_top, _, want_load = reference(clean.double(), z.double(), noise.double(), k, True)
        loss = w_top_scale * (top * w_top).sum() + w_load_scale * (load * w_load).sum()
        want_loss = w_top_scale * (want_top * w_top.double()).sum() + w_load_scale * (want_load * w_load.double()).sum()
        return torch.autograd.grad(loss, z)[0].double(), torch.autograd.grad(want_loss, z)[0]

    got, want = grad_z(1.0, 0.0)
    assert want.ne(0).sum() == n * k + n   # every row's top K1 entries have a gradient
    nonzero = want.ne(0)
    assert torch.equal(got.ne(0), nonzero)
    assert ((got - want)[nonzero] / want[nonzero]).abs().max() < 1e-5
    got, want = grad_z(1.0, 1.0)
    assert want.ne(0).float().mean() > 0.5    # the load reaches most entries
    assert (got - want).norm() / want.norm() < 1e-5


def test_zero_eps_where_the_std_underflows_gives_a_step_not_nan():
    """eps = 0 and softplus(z) = 0 (z = -200 in float32): std is 0, and the standardisation divides by 1e-20
    instead (the load is then a step: 0, 1/2 or 1 per entry); values and gradients stay finite."""
    gen = torch.Generator().manual_seed(3)
    clean = torch.randn(16, 6, generator=gen).requires_grad_(True)
    z = torch.full((16, 6), -200.0, requires_grad=True)
    noise = torch.randn(16, 6, generator=gen)
    top, _, load = noisy_top_k(clean, z, noise, 0.0, 2, True)
    assert torch.isfinite(load).all() and torch.equal(load * 2, (load * 2).round())   # sums of 0, 1/2 and 1
    grads = torch.autograd.grad(top.sum() + load.sum(), (clean, z))
    assert all(torch.isfinite(g).all() for g in grads)
