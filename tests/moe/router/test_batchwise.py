"""Strictly balanced gating (App. F, spec §1.7, §6 item 6, §7 item 8)."""

import pytest
import torch
import torch.distributed as dist

from moe_scale.distributed.comm import BatchCollectives
from moe_scale.moe.router import RouterOutput
from moe_scale.moe.router.batchwise import BatchwiseRouter, batchwise_mask
from tests.multiproc import run_ranks


def make_router(d=8, e=6, k=2, seed=0, scale=1.0, zero=False, **kw):
    torch.manual_seed(seed)
    router = BatchwiseRouter(d, e, k, **kw)
    with torch.no_grad():
        if zero:
            router.w_gate.zero_()
        else:
            router.w_gate.copy_(torch.randn(d, e, generator=torch.Generator().manual_seed(seed)) * scale)
    return router


def logit_router(logits_NE, k, **kw):
    """A router whose logits equal x (w_gate = identity), so tests can write S directly."""
    e = logits_NE.shape[1]
    router = BatchwiseRouter(e, e, k, **kw)
    with torch.no_grad():
        router.w_gate.copy_(torch.eye(e))
    return router


def dense_mask(route: RouterOutput, n, e):
    mask = torch.zeros(n, e, dtype=torch.bool)
    mask[route.token_C, route.expert_C] = True
    return mask


def dense_gates(route: RouterOutput, n, e):
    g = torch.zeros(n, e, dtype=route.gate_C.dtype)
    g[route.token_C, route.expert_C] = route.gate_C.detach()
    return g


def scores(router, x):
    return torch.softmax(x.float() @ router.w_gate.detach(), dim=-1)


def set_thresholds(router, t_E):
    with torch.no_grad():
        router.thresholds.copy_(t_E)
        router.thresholds_initialized.fill_(True)


# ---------------------------------------------------------------------------------------------- training mask


@pytest.mark.parametrize("zero", [False, True])
def test_training_gives_exactly_m_tokens_per_expert(zero):
    n, e, k = 40, 6, 2
    router = make_router(e=e, k=k, zero=zero).train()
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(1))
    route = router(x)
    m = k * n // e
    mask = dense_mask(route, n, e)
    assert route.metrics["tokens_per_expert"] == m
    assert mask.sum(0).tolist() == [m] * e
    assert route.load_E.tolist() == [m] * e
    assert len(route.token_C) == m * e  # no duplicate pairs
    # not all experts took the same m rows (the zero-init pitfall: topk would pick the first m everywhere)
    assert mask.any(1).sum() > m
    if not zero:  # the selected rows are the top-m of each column of S
        s = scores(router, x)
        for i in range(e):
            assert set(mask[:, i].nonzero().flatten().tolist()) == set(s[:, i].topk(m).indices.tolist())


def test_ties_from_identical_tokens_spread_over_rows():
    n, e, k = 30, 5, 1
    router = make_router(e=e, k=k).train()
    x = torch.randn(1, 8).expand(n, 8)  # every row ties in every column
    mask = dense_mask(router(x), n, e)
    m = k * n // e
    assert mask.sum(0).tolist() == [m] * e
    assert len({tuple(mask[:, i].nonzero().flatten().tolist()) for i in range(e)}) == e


def test_m_uses_floor_and_at_least_one():
    router = make_router(e=8, k=1).train()
    mask = dense_mask(router(torch.randn(5, 8)), 5, 8)  # k*B/n = 0.625 -> m = 1
    assert mask.sum(0).tolist() == [1] * 8


def test_padding_rows_take_no_capacity():
    n, e, k = 20, 4, 2
    router = make_router(e=e, k=k).train()
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(3))
    valid = torch.ones(n, dtype=torch.bool)
    valid[::3] = False
    route = router(x, valid)
    mask = dense_mask(route, n, e)
    m = k * int(valid.sum()) // e
    assert mask.sum(0).tolist() == [m] * e
    assert not mask[~valid].any()
    # same as routing the valid rows alone
    ref = make_router(e=e, k=k).train()(x[valid])
    assert torch.equal(dense_mask(ref, int(valid.sum()), e), mask[valid])


# ---------------------------------------------------------------------------------------------- gates


def test_gates_are_renormalised_scores_with_empty_and_crowded_rows():
    # n=3, k=1, B=8 -> m=2. Row 5 wins columns 0 and 1 (two experts); rows 4, 6, 7 win no column.
    logits = torch.tensor([[6.0, 0, 0], [0, 6.0, 0], [0, 0, 6.0], [0, 0, 5.0], [0.0, 0, 0], [9.0, 9.0, -9.0],
                           [-3.0, -3.0, 0], [-3.0, -3.0, 0]])
    router = logit_router(logits, k=1).train()
    route = router(logits)
    n, e = logits.shape
    mask = dense_mask(route, n, e)
    assert mask.sum(0).tolist() == [2, 2, 2]
    counts = mask.sum(1)
    assert (counts == 0).any() and (counts > 1).any()  # a token with no expert, and one with more than k
    s = torch.softmax(logits, -1)
    sm = s * mask
    ref = sm / sm.sum(-1, keepdim=True).clamp_min(1e-30)
    g = dense_gates(route, n, e)
    assert torch.isfinite(route.gate_C).all() and (route.gate_C > 0).all()
    torch.testing.assert_close(g, ref)
    row_sums = g.sum(1)
    torch.testing.assert_close(row_sums[counts > 0], torch.ones(int((counts > 0).sum())))
    assert (row_sums[counts == 0] == 0).all()
    assert route.metrics["tokens_without_expert"] == pytest.approx((counts == 0).float().mean().item())
    torch.testing.assert_close(route.importance_E, ref.sum(0))


def test_task_gradient_reaches_w_gate_only_on_selected_entries():
    router = make_router(e=4, k=2, w_importance=0.0, threshold_loss_weight=0.0).train()
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(5))
    route = router(x)
    (route.gate_C * torch.randn(route.gate_C.shape[0])).sum().backward()
    assert router.w_gate.grad is not None and router.w_gate.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- threshold loss


def loss_and_masks(router, x):
    route = router(x)
    s = scores(router, x)
    m_thr = s > router.thresholds.detach()
    m_b = dense_mask(route, *s.shape)
    return route, m_thr, m_b


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_threshold_loss_nonnegative_and_zero_iff_masks_agree(reduction):
    n, e, k = 24, 6, 2
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(7))
    router = make_router(e=e, k=k, w_importance=0.0, threshold_reduction=reduction).train()
    router(x)  # first batch initialises T at the midpoints: masks agree
    route = router(x)
    assert route.metrics["threshold_agreement"] == 1.0
    assert route.aux_loss.item() == 0.0
    gen = torch.Generator().manual_seed(8)
    s = scores(router, x)
    saw_disagreement = False
    for trial in range(20):
        t = s[torch.randint(n, (e,), generator=gen), torch.arange(e)] + 1e-4 * torch.randn(e, generator=gen)
        set_thresholds(router, t)
        route, m_thr, m_b = loss_and_masks(router, x)
        agree = bool((m_thr == m_b).all())
        saw_disagreement |= not agree
        loss = route.aux_loss.item()
        assert loss >= 0
        assert (loss == 0) == agree
        assert route.metrics["threshold_agreement"] == pytest.approx((m_thr == m_b).float().mean().item())
        ref = ((m_thr.float() - m_b.float()) * (s - t)).sum() / (n if reduction == "mean" else 1)
        assert loss == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    assert saw_disagreement
    set_thresholds(router, torch.ones(e))  # T above everything: loss = Σ_selected (T − S) > 0
    assert router(x).aux_loss.item() > 0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_threshold_gradient_and_sgd_step(reduction):
    n, e, k = 30, 5, 2
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(9))
    router = make_router(e=e, k=k, w_importance=0.0, threshold_reduction=reduction,
                         init_thresholds_from_batch=False).train()
    s = scores(router, x)
    set_thresholds(router, torch.tensor([0.05, 0.9, s[:, 2].median(), s[:, 3].quantile(0.2), 1.0]))
    route, m_thr, m_b = loss_and_masks(router, x)
    route.aux_loss.backward()
    expected = (m_b.float() - m_thr.float()).sum(0) / (n if reduction == "mean" else 1)
    torch.testing.assert_close(router.thresholds.grad, expected, rtol=1e-6, atol=0)  # exact up to the /B rounding
    assert router.w_gate.grad is None or (router.w_gate.grad == 0).all()  # detached scores: L_bw trains T only
    before = router.thresholds.detach().clone()
    loss_before = route.aux_loss.item()
    torch.optim.SGD([router.thresholds], lr=1e-3).step()
    step = router.thresholds.detach() - before
    # T rises where it lets through too many tokens (M_thr > M_b), falls where too few; along −Σ(M_b − M_thr)
    assert torch.equal(torch.sign(step), -torch.sign(expected))
    assert expected[0] < 0 and expected[1] > 0  # a too-low and a too-high threshold were both exercised
    assert router(x).aux_loss.item() < loss_before


def test_detach_scores_false_lets_threshold_loss_reach_w_gate():
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10))
    grads = {}
    for detach in (True, False):
        router = make_router(e=4, k=1, w_importance=0.0, detach_scores=detach,
                             init_thresholds_from_batch=False).train()
        set_thresholds(router, torch.full((4,), 0.05))
        route = router(x)
        assert route.aux_loss.item() > 0
        route.aux_loss.backward()
        grads[detach] = router.w_gate.grad
    assert grads[True] is None or (grads[True] == 0).all()
    assert grads[False].abs().sum() > 0


def test_threshold_loss_weight_and_no_loss_at_eval():
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(11))
    losses = []
    for weight in (1.0, 3.0):
        router = make_router(e=4, k=1, w_importance=0.0, threshold_loss_weight=weight,
                             init_thresholds_from_batch=False).train()
        set_thresholds(router, torch.full((4,), 0.05))
        losses.append(router(x).aux_loss.item())
        assert router.eval()(x).aux_loss.item() == 0.0
    assert losses[1] == pytest.approx(3 * losses[0])


# ---------------------------------------------------------------------------------------------- init and eval


def test_threshold_init_from_first_batch():
    n, e, k = 36, 6, 2
    m = k * n // e
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(12))
    router = make_router(e=e, k=k).train()
    torch.testing.assert_close(router.thresholds.detach(), torch.full((e,), 1.0 / e))
    assert not router.thresholds_initialized
    route = router(x)
    assert router.thresholds_initialized and "thresholds_initialized" in router.state_dict()
    s_sorted = scores(router, x).sort(dim=0, descending=True).values
    t = router.thresholds.detach()
    assert (s_sorted[m] < t).all() and (t < s_sorted[m - 1]).all()
    torch.testing.assert_close(t, (s_sorted[m - 1] + s_sorted[m]) / 2)
    assert route.metrics["threshold_agreement"] == 1.0
    assert route.metrics["threshold_loss"] == 0.0
    # later batches don't re-initialise; the flag survives a state-dict round trip
    router(torch.randn(n, 8, generator=torch.Generator().manual_seed(13)))
    assert torch.equal(router.thresholds.detach(), t)
    fresh = BatchwiseRouter(8, e, k)
    fresh.load_state_dict(router.state_dict())
    assert fresh.thresholds_initialized and torch.equal(fresh.thresholds.detach(), t)
    fresh.train()(torch.randn(n, 8))
    assert torch.equal(fresh.thresholds.detach(), t)


def test_eval_uses_threshold_mask_with_argmax_fallback():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0], [0.3, 0.2, 0.1], [1.0, 1.0, -5.0]])
    router = logit_router(logits, k=1).eval()
    t = torch.tensor([0.45, 0.4, 0.6])
    set_thresholds(router, t)
    route = router(logits)
    s = torch.softmax(logits, -1)
    m_thr = s > t
    assert m_thr[2].sum() == 0 and m_thr[3].sum() == 2  # row 2 passes no threshold, row 3 passes two
    mask = dense_mask(route, 4, 3)
    expected = m_thr.clone()
    expected[2, s[2].argmax()] = True
    assert torch.equal(mask, expected)
    g = dense_gates(route, 4, 3)
    assert g[2, 0].item() == 1.0
    torch.testing.assert_close(g[3], s[3] * m_thr[3] / (s[3] * m_thr[3]).sum())
    assert route.metrics["tokens_without_expert"] == 0.25
    # eval routing has no batch dependence: each row alone routes the same
    for j in range(4):
        alone = router(logits[j : j + 1])
        assert torch.equal(dense_mask(alone, 1, 3)[0], mask[j])
    # the agreement metric compares against M_batchwise on the eval batch (m = floor(4/3) = 1)
    m_b = batchwise_mask(s, 1, torch.ones(4, dtype=torch.bool))
    assert route.metrics["threshold_agreement"] == pytest.approx((m_b == m_thr).float().mean().item())
    assert route.load_E.tolist() == mask.sum(0).float().tolist()


# ---------------------------------------------------------------------------------------------- construction


def test_parameter_names_and_bad_arguments():
    router = BatchwiseRouter(8, 4, 2)
    names = [name for name, _ in router.named_parameters()]
    assert sorted(names) == ["thresholds", "w_gate"]
    assert not any("expert" in name for name in list(router.state_dict()))
    assert router.w_gate.shape == (8, 4) and router.thresholds.shape == (4,)
    for k in (0, -1, 5):
        with pytest.raises(ValueError, match="k"):
            BatchwiseRouter(8, 4, k)
    with pytest.raises(ValueError, match="scope"):
        BatchwiseRouter(8, 4, 2, scope="world")
    with pytest.raises(ValueError, match="threshold_reduction"):
        BatchwiseRouter(8, 4, 2, threshold_reduction="avg")
    BatchwiseRouter(8, 4, 4)  # k == n is allowed


def test_k_equals_n_selects_everything():
    router = make_router(e=4, k=4).train()
    route = router(torch.randn(10, 8))
    assert dense_mask(route, 10, 4).all()
    assert route.metrics["threshold_agreement"] == 1.0


# ---------------------------------------------------------------------------------------------- 2 ranks

N_LOCAL, D, E, K = 12, 8, 6, 2


def _case_inputs(seed, world):
    x = torch.randn(N_LOCAL * world, D, generator=torch.Generator().manual_seed(seed))
    return x


def _rank_router(rank, world, scope, zero, seed):
    router = make_router(d=D, e=E, k=K, seed=seed, zero=zero, scope=scope, w_importance=0.5).train()
    router.connect(BatchCollectives(dist.group.WORLD))        # as MoELayer wires it
    return router


def _worker(rank, world, scope, zero, seed):
    x = _case_inputs(seed, world)[rank * N_LOCAL : (rank + 1) * N_LOCAL]
    router = _rank_router(rank, world, scope, zero, seed)
    torch.manual_seed(1000 + rank)  # ranks' RNG states differ in practice: tie-breaking must not depend on them
    route = router(x)
    route.aux_loss.backward()
    token, expert, gate = route.pairs()
    return dict(token=token, expert=expert, gate=gate.detach(), importance=route.importance_E.detach(),
                load=route.load_E, aux=route.aux_loss.item(), metrics=route.metrics,
                thresholds=router.thresholds.detach().clone(), grad=router.w_gate.grad.clone())


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", [False, True])
def test_global_scope_on_two_ranks_equals_one_process(zero):
    world, seed = 2, 20
    results = run_ranks(_worker, world_size=world, args=("global", zero, seed))
    x = _case_inputs(seed, world)
    ref_router = make_router(d=D, e=E, k=K, seed=seed, zero=zero, scope="global", w_importance=0.5).train()
    ref = ref_router(x)
    ref.aux_loss.backward()
    n = N_LOCAL * world
    m = K * n // E
    ref_mask, ref_gates = dense_mask(ref, n, E), dense_gates(ref, n, E)
    masks = []
    for rank, res in enumerate(results):
        rows = slice(rank * N_LOCAL, (rank + 1) * N_LOCAL)
        mask = torch.zeros(N_LOCAL, E, dtype=torch.bool)
        mask[res["token"], res["expert"]] = True
        gates = torch.zeros(N_LOCAL, E)
        gates[res["token"], res["expert"]] = res["gate"]
        assert torch.equal(mask, ref_mask[rows])
        torch.testing.assert_close(gates, ref_gates[rows])
        torch.testing.assert_close(res["importance"], ref.importance_E.detach())
        torch.testing.assert_close(res["load"], ref.load_E)
        torch.testing.assert_close(res["thresholds"], ref_router.thresholds.detach())
        assert res["metrics"]["threshold_agreement"] == pytest.approx(ref.metrics["threshold_agreement"])
        assert res["metrics"]["tokens_per_expert"] == m
        masks.append(mask)
    assert torch.cat(masks).sum(0).tolist() == [m] * E  # exactly m tokens of the global batch per expert
    if zero:
        assert torch.cat(masks).any(1).sum() > m
    # w_gate's gradient (importance loss only; L_bw is detached from S): the autograd all-reduce sums the
    # upstream gradient too, so the ranks' gradients add up to world_size x the 1-process gradient, i.e. their
    # data-parallel average is the 1-process gradient.
    total_grad = results[0]["grad"] + results[1]["grad"]
    torch.testing.assert_close(total_grad, 2 * ref_router.w_gate.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.multiprocess
def test_local_scope_on_two_ranks():
    world, seed = 2, 21
    results = run_ranks(_worker, world_size=world, args=("local", False, seed))
    x = _case_inputs(seed, world)
    m_local = K * N_LOCAL // E
    importance, load, ts = 0, 0, []
    for rank, res in enumerate(results):
        mask = torch.zeros(N_LOCAL, E, dtype=torch.bool)
        mask[res["token"], res["expert"]] = True
        assert mask.sum(0).tolist() == [m_local] * E
        ref_router = make_router(d=D, e=E, k=K, seed=seed, scope="local", w_importance=0.5).train()
        ref = ref_router(x[rank * N_LOCAL : (rank + 1) * N_LOCAL])
        assert torch.equal(dense_mask(ref, N_LOCAL, E), mask)
        importance = importance + ref.importance_E.detach()
        load = load + ref.load_E
        ts.append(ref_router.thresholds.detach())
    for res in results:
        torch.testing.assert_close(res["importance"], importance)
        torch.testing.assert_close(res["load"], load)
        # T initialised from the first batch is the rank-average of the local midpoints, identical on every rank
        torch.testing.assert_close(res["thresholds"], (ts[0] + ts[1]) / 2)
    assert load.tolist() == [world * m_local] * E
