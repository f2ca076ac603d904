import math

import pytest
import torch
import torch.nn.functional as F

from moe_scale.moe.router import RouterOutput
from moe_scale.moe.router.softmax_topk import SoftmaxTopKRouter, switch_loss
from tests.multiproc import run_ranks
from tests.moe.router.collectives import SumWith


def make_router(d=8, e=6, k=2, seed=0, scale=0.5, **kw):
    router = SoftmaxTopKRouter(d, e, k, **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.w_gate.copy_(torch.randn(d, e, generator=gen) * scale)
    return router


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference(router, x_ND):
    """Straight transcription of the MoA code (moe.py top_k_gating, compute_switchloss, compute_zloss) in float64:
    F.normalize(p=1) on both vectors, naive log(exp(.).sum()), dense gates matrix."""
    logits = x_ND.double() @ router.w_gate.double()
    probs = torch.softmax(logits, dim=1)
    top_p, idx = probs.topk(router.k, dim=1)
    if router.renormalize == "detached":
        top_p = top_p / top_p.sum(1, keepdim=True).detach()
    elif router.renormalize == "full":
        top_p = top_p / top_p.sum(1, keepdim=True)
    dense = torch.zeros_like(probs).scatter(1, idx, top_p)
    selected = torch.zeros_like(probs).scatter(1, idx, 1.0)
    l_a = router.num_experts * (F.normalize(probs.sum(0), p=1, dim=0) * F.normalize(selected.sum(0), p=1, dim=0)).sum()
    l_z = torch.log(torch.exp(logits).sum(1)).pow(2).mean()
    return top_p, idx, l_a, l_z, dense.sum(0), selected.sum(0)


# ---------------------------------------------------------------- construction


def test_parameters_no_bias_not_zero_and_checkpoint_safe_names():
    router = SoftmaxTopKRouter(16, 8, 2)
    names = [n for n, _ in router.named_parameters()]
    assert names == ["w_gate"] and not any("expert" in n for n in names)
    assert router.w_gate.shape == (16, 8)
    assert router.w_gate.abs().min() > 0  # small random init, not zeros
    assert router.w_gate.std().item() == pytest.approx(1e-2 / 4, rel=0.3)
    x = torch.randn(64, 16)
    out = router(x)
    assert isinstance(out, RouterOutput)
    assert len(set(map(tuple, out.experts_NK.sort(1).values.tolist()))) > 1  # no zero-init tie


@pytest.mark.parametrize("kw", [dict(k=0), dict(k=7), dict(k=-1), dict(renormalize="fully"),
                                dict(renormalize="detach")])
def test_bad_arguments_raise(kw):
    args = dict(d_model=4, num_experts=6, k=2) | kw
    with pytest.raises(ValueError):
        SoftmaxTopKRouter(**args)


# ---------------------------------------------------------------- gates

TOL = dict(rtol=1e-5, atol=1e-6)  # float32 router against the float64 reference


@pytest.mark.parametrize("renormalize", ["none", "detached", "full"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_gates_importance_load_and_losses_match_reference(renormalize, k):
    router = make_router(e=6, k=k, renormalize=renormalize, aux_weight=0.3, z_weight=0.07)
    x = randn(50, 8)
    out = router(x)
    top_p, idx, l_a, l_z, importance, load = reference(router, x)
    assert out.gates_NK.dtype == torch.float32 and out.experts_NK.shape == (50, k)
    torch.testing.assert_close(out.experts_NK, idx)
    torch.testing.assert_close(out.gates_NK.double(), top_p, **TOL)
    torch.testing.assert_close(out.importance_E.double(), importance, **TOL)
    torch.testing.assert_close(out.load_E.double(), load, **TOL)
    torch.testing.assert_close(out.aux_loss.double(), 0.3 * l_a + 0.07 * l_z, **TOL)
    assert out.metrics["switch_loss"] == pytest.approx(l_a.item(), rel=1e-5)
    assert out.metrics["z_loss"] == pytest.approx(l_z.item(), rel=1e-5)
    token_C, expert_C, gate_C = out.pairs()
    assert token_C.shape == expert_C.shape == gate_C.shape == (50 * k,)


def test_gates_are_raw_top_k_probs_or_sum_to_one_and_agree_when_k_equals_e():
    x = randn(30, 8)
    raw = make_router(k=2, renormalize="none")(x)
    ren = make_router(k=2, renormalize="detached")(x)
    probs = torch.softmax(x @ make_router().w_gate, dim=1)
    torch.testing.assert_close(raw.gates_NK, probs.topk(2, dim=1).values)
    assert (raw.gates_NK.sum(1) < 1 - 1e-3).all()
    torch.testing.assert_close(ren.gates_NK.sum(1), torch.ones(30))
    torch.testing.assert_close(ren.gates_NK, raw.gates_NK / raw.gates_NK.sum(1, keepdim=True))
    full_raw, full_ren = make_router(k=6, renormalize="none")(x), make_router(k=6, renormalize="detached")(x)
    torch.testing.assert_close(full_raw.gates_NK, full_ren.gates_NK)
    torch.testing.assert_close(full_raw.experts_NK, full_ren.experts_NK)


def test_detached_denominator_carries_no_gradient():
    x, y = randn(40, 8), randn(40, 2, seed=3)
    router = make_router(k=2, renormalize="detached", aux_weight=0.0, z_weight=0.0)
    (router(x).gates_NK * y).sum().backward()
    w = make_router(k=2).w_gate.detach().requires_grad_()

    def manual(detach):
        top_p = torch.softmax(x @ w, dim=1).topk(2, dim=1).values
        s = top_p.sum(1, keepdim=True)
        return torch.autograd.grad(((top_p / (s.detach() if detach else s)) * y).sum(), w)[0]

    torch.testing.assert_close(router.w_gate.grad, manual(detach=True))
    assert not torch.allclose(router.w_gate.grad, manual(detach=False), atol=1e-4)


def test_full_renormalisation_is_mixtrals_router_in_value_and_gradient():
    """"full" gives the gates of transformers' MixtralTopKRouter (softmax in float32, top-k, divided by their sum),
    which are a softmax over the k kept logits, and their gradient; "detached" has the same values and another
    gradient."""
    x, y = randn(40, 8), randn(40, 2, seed=3)
    router = make_router(k=2, renormalize="full", aux_weight=0.0, z_weight=0.0)
    out = router(x)
    (out.gates_NK * y).sum().backward()
    w = make_router(k=2).w_gate.detach().double().requires_grad_()
    logits = x.double() @ w
    mixtral = torch.softmax(logits, dim=-1).topk(2, dim=-1)   # MixtralTopKRouter.forward, transcribed
    mixtral_gates = mixtral.values / mixtral.values.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(out.experts_NK, mixtral.indices)
    torch.testing.assert_close(out.gates_NK.double(), mixtral_gates, **TOL)
    torch.testing.assert_close(mixtral_gates, torch.softmax(logits.gather(1, mixtral.indices), dim=1))
    want = torch.autograd.grad((mixtral_gates * y.double()).sum(), w)[0]
    torch.testing.assert_close(router.w_gate.grad.double(), want, **TOL)
    detached = make_router(k=2, renormalize="detached", aux_weight=0.0, z_weight=0.0)
    detached_out = detached(x)
    torch.testing.assert_close(detached_out.gates_NK, out.gates_NK)
    (detached_out.gates_NK * y).sum().backward()
    assert not torch.allclose(detached.w_gate.grad, router.w_gate.grad, atol=1e-4)


def test_half_precision_input_under_autocast_computes_in_float32():
    router = make_router()
    x = randn(20, 8)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = router(x.bfloat16())
    assert out.gates_NK.dtype == torch.float32 and out.aux_loss.dtype == torch.float32


# ---------------------------------------------------------------- losses


def test_switch_loss_is_one_at_uniform_routing():
    e = 4
    # Zero gate: uniform probabilities (whatever the tie-broken selection is).
    router = SoftmaxTopKRouter(e, e, 1)
    with torch.no_grad():
        router.w_gate.zero_()
    assert router(randn(12, e)).metrics["switch_loss"] == pytest.approx(1.0)
    # Tie-free balanced routing: token t prefers expert t mod E; probability sums and counts are both uniform.
    with torch.no_grad():
        router.w_gate.copy_(3.0 * torch.eye(e))
    x = torch.eye(e).repeat(3, 1)
    out = router(x)
    torch.testing.assert_close(out.load_E, torch.full((e,), 3.0))
    assert out.metrics["switch_loss"] == pytest.approx(1.0, rel=1e-6)
    # ...and not 1 when the routing is unbalanced.
    assert router(x[:5]).metrics["switch_loss"] > 1.05


def test_switch_loss_is_e_when_collapsed():
    e = 8
    router = SoftmaxTopKRouter(4, e, 1, aux_weight=1.0, z_weight=0.0)
    with torch.no_grad():
        router.w_gate.zero_()
        router.w_gate[:, 3] = 20.0
    out = router(torch.rand(32, 4) + 1.0)  # positive inputs: logit of expert 3 >= 20, others 0
    assert (out.experts_NK == 3).all()
    assert out.metrics["switch_loss"] == pytest.approx(e, rel=1e-6)
    torch.testing.assert_close(out.aux_loss, torch.tensor(float(e)))
    assert switch_loss(torch.tensor([5.0, 0, 0]), torch.tensor([5.0, 0, 0])).item() == pytest.approx(3.0)


def test_switch_loss_is_identically_one_without_gradient_when_k_equals_e():
    for seed in range(3):
        router = make_router(e=5, k=5, seed=seed, scale=2.0, aux_weight=1.0, z_weight=0.0)
        out = router(randn(20, 8, seed=seed))
        assert out.metrics["switch_loss"] == pytest.approx(1.0, rel=1e-6)
        out.aux_loss.backward()
        assert router.w_gate.grad.abs().max() < 1e-6


def test_z_loss_at_zero_logits_is_log_e_squared():
    router = SoftmaxTopKRouter(4, 8, 2, aux_weight=0.0, z_weight=1.0)
    with torch.no_grad():
        router.w_gate.zero_()
    out = router(randn(10, 4))
    assert out.metrics["z_loss"] == pytest.approx(math.log(8) ** 2, rel=1e-6)  # 4.3241
    assert out.aux_loss.item() == pytest.approx(4.3241, abs=1e-4)


def test_z_loss_is_finite_for_huge_logits():
    router = make_router(scale=1e3)
    out = router(randn(10, 8))
    assert math.isfinite(out.metrics["z_loss"]) and out.metrics["z_loss"] > 1e4


@pytest.mark.parametrize("renormalize", ["none", "detached", "full"])
def test_gradients_reach_w_gate_from_task_loss_and_each_aux_loss(renormalize):
    x, y = randn(40, 8), randn(40, 2, seed=3)
    grads = {}
    for name, (aw, zw) in {"task": (0.0, 0.0), "switch": (1.0, 0.0), "z": (0.0, 1.0)}.items():
        router = make_router(k=2, renormalize=renormalize, aux_weight=aw, z_weight=zw)
        out = router(x)
        loss = (out.gates_NK * y).sum() if name == "task" else out.aux_loss
        loss.backward()
        grads[name] = router.w_gate.grad
        assert grads[name].abs().max() > 1e-4, name
    # The aux gradients are those of the reference formulas.
    w = make_router(k=2).w_gate.detach().double().requires_grad_()
    probs = torch.softmax(x.double() @ w, dim=1)
    sel = torch.zeros_like(probs).scatter(1, probs.topk(2, dim=1).indices, 1.0)
    l_a = 6 * (probs.sum(0) / 40 * sel.sum(0) / 80).sum()
    torch.testing.assert_close(grads["switch"].double(), torch.autograd.grad(l_a, w)[0])
    l_z = torch.logsumexp(x.double() @ w, dim=1).pow(2).mean()
    torch.testing.assert_close(grads["z"].double(), torch.autograd.grad(l_z, w)[0])


def test_aux_loss_gradient_matches_finite_differences():
    router = make_router(e=5, k=2).double()
    x = randn(16, 8).double()
    # Central differences of aux_loss against autograd, on a few entries of w_gate (float64).
    out = router(x)
    out.aux_loss.backward()
    g = router.w_gate.grad.clone()
    eps = 1e-6
    for i, j in [(0, 0), (3, 2), (7, 4)]:
        with torch.no_grad():
            router.w_gate[i, j] += eps
            up = router(x).aux_loss.item()
            router.w_gate[i, j] -= 2 * eps
            down = router(x).aux_loss.item()
            router.w_gate[i, j] += eps
        assert g[i, j].item() == pytest.approx((up - down) / (2 * eps), rel=1e-4, abs=1e-9)


# ---------------------------------------------------------------- data-parallel statistics


def test_batch_sum_is_called_once_on_one_tensor_even_without_tokens():
    router = make_router(e=6)
    calls = []
    router.connect(SumWith(lambda t: calls.append(t.shape) or t))
    router(randn(10, 8))
    out = router(torch.randn(0, 8))
    assert calls == [(3 * 6 + 2,), (3 * 6 + 2,)]
    assert torch.isfinite(out.aux_loss) and out.gates_NK.shape == (0, 2)


def test_identical_shards_leave_losses_unchanged():
    x = randn(30, 8)
    single, doubled = make_router(), make_router()
    doubled.connect(SumWith(lambda t: t * 2))
    a, b = single(x), doubled(x)
    torch.testing.assert_close(b.importance_E, 2 * a.importance_E)
    torch.testing.assert_close(b.load_E, 2 * a.load_E)
    torch.testing.assert_close(a.aux_loss, b.aux_loss)


def _two_rank_worker(rank, world, renormalize):
    import torch.distributed as dist

    from moe_scale.distributed.comm import BatchCollectives

    torch.manual_seed(123)
    router = make_router(k=2, renormalize=renormalize, aux_weight=0.5, z_weight=0.2)
    router.connect(BatchCollectives(dist.group.WORLD))
    x = randn(2 * 24 + 6, 8, seed=11)
    shard = x[:30] if rank == 0 else x[30:]  # unequal shards: the token count must be global
    out = router(shard)
    out.aux_loss.backward()
    return dict(aux=out.aux_loss.detach(), importance=out.importance_E.detach(), load=out.load_E,
                metrics=out.metrics, grad=router.w_gate.grad, gates=out.gates_NK.detach(), experts=out.experts_NK)


@pytest.mark.multiprocess
@pytest.mark.parametrize("renormalize", ["none", "detached"])
def test_two_ranks_equal_one_process_on_the_concatenated_batch(renormalize):
    r0, r1 = run_ranks(_two_rank_worker, world_size=2, args=(renormalize,))
    router = make_router(k=2, renormalize=renormalize, aux_weight=0.5, z_weight=0.2)
    full = router(randn(2 * 24 + 6, 8, seed=11))
    full.aux_loss.backward()
    for r in (r0, r1):
        torch.testing.assert_close(r["aux"], full.aux_loss.detach())
        torch.testing.assert_close(r["importance"], full.importance_E.detach())
        torch.testing.assert_close(r["load"], full.load_E)
        assert {k: float(v) for k, v in r["metrics"].items()} == \
            pytest.approx({k: float(v) for k, v in full.metrics.items()})
    torch.testing.assert_close(torch.cat([r0["gates"], r1["gates"]]), full.gates_NK.detach())
    torch.testing.assert_close(torch.cat([r0["experts"], r1["experts"]]), full.experts_NK)
    # Autograd all-reduce: the data-parallel mean of the rank gradients is the 1-process gradient.
    torch.testing.assert_close((r0["grad"] + r1["grad"]) / 2, router.w_gate.grad)
    # ...and the local-only statistics would differ.
    local = make_router(k=2, renormalize=renormalize, aux_weight=0.5, z_weight=0.2)(randn(54, 8, seed=11)[:30])
    assert local.aux_loss.item() != pytest.approx(r0["aux"].item(), rel=1e-6)
