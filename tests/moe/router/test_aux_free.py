"""The auxiliary-loss-free gate (DeepSeek-V3): routing by score + bias, gates from the scores alone, the bias update
against a hand loop, balance without any auxiliary loss, the sequence-wise loss by hand, and 2 ranks == 1."""

import math

import pytest
import torch

from moe_scale.moe.losses import cv_squared
from moe_scale.moe.router import AuxFreeRouter
from moe_scale.moe.router.aux_free import sequence_balance_sums
from tests.moe.router.collectives import SumWith
from tests.multiproc import run_ranks

D, E, K = 8, 6, 2


def make_router(seed=0, scale=0.5, **kw):
    torch.manual_seed(seed)
    router = AuxFreeRouter(D, E, K, **kw)
    with torch.no_grad():
        router.w_gate.copy_(torch.randn(D, E) * scale)
    return router


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference(router, x_ND, bias_E):
    """Token by token: the top K of score + bias, gates the chosen scores (sigmoid: divided by their sum)."""
    logits_NE = x_ND @ router.w_gate.detach()
    scores_NE = torch.sigmoid(logits_NE) if router.score == "sigmoid" else torch.softmax(logits_NE, 1)
    experts, gates = [], []
    for s_E in scores_NE:
        chosen = sorted(range(E), key=lambda i: -(float(s_E[i]) + float(bias_E[i])))[:K]
        g = s_E[chosen]
        experts.append(chosen)
        gates.append(g / g.sum() if router.score == "sigmoid" else g)
    return torch.tensor(experts), torch.stack(gates)


# ---------------------------------------------------------------- routing and gates


def test_parameters_buffer_and_checkpoint_safe_names():
    router = make_router()
    assert [name for name, _ in router.named_parameters()] == ["w_gate"]
    assert [name for name, _ in router.named_buffers()] == ["score_bias"]
    assert set(router.state_dict()) == {"w_gate", "score_bias"}          # the bias is checkpointed
    assert not any("expert" in key for key in router.state_dict())      # DeepSpeed reads "expert" as an expert
    assert not router.score_bias.requires_grad and torch.count_nonzero(router.score_bias) == 0


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_top_k_of_score_plus_bias_with_gates_from_the_scores(score):
    router = make_router(score=score)
    x = randn(40, D)
    bias = torch.tensor([0.3, -0.2, 0.0, 0.25, -0.4, 0.1])
    router.score_bias.copy_(bias)
    out = router(x)
    want_experts, want_gates = reference(router, x, bias)
    torch.testing.assert_close(out.experts_NK, want_experts)
    torch.testing.assert_close(out.gates_NK, want_gates)
    unbiased, _ = reference(router, x, torch.zeros(E))
    assert (unbiased != want_experts).any(), "the bias must change some choice for this test to mean anything"
    if score == "sigmoid":
        torch.testing.assert_close(out.gates_NK.sum(1), torch.ones(40))
    assert out.aux_loss.item() == 0 and out.metrics["bias_spread"].item() == pytest.approx(0.7)
    torch.testing.assert_close(out.load_E, torch.bincount(want_experts.reshape(-1), minlength=E).float())
    torch.testing.assert_close(out.importance_E, torch.zeros(E).index_add(0, want_experts.reshape(-1),
                                                                        want_gates.reshape(-1)))


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_the_bias_never_changes_the_gate_values_gradient(score):
    """The gradient reaching w_gate is that of the unbiased scores of the chosen experts: computed with the
    experts taken as given, without the bias anywhere in the graph. A bias that changes no choice (a constant
    added to every expert) changes nothing at all, bitwise."""
    x, upstream = randn(30, D), randn(30, K, seed=3)
    router = make_router(score=score)
    router.score_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.25, -0.4, 0.1]))
    out = router(x)
    (out.gates_NK * upstream).sum().backward()
    got = router.w_gate.grad.clone()

    w = router.w_gate.detach().clone().requires_grad_(True)
    logits = x @ w
    scores = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, 1)
    chosen = scores.gather(1, out.experts_NK)
    gates = chosen / chosen.sum(1, keepdim=True) if score == "sigmoid" else chosen
    (gates * upstream).sum().backward()
    torch.testing.assert_close(got, w.grad)

    shifted = make_router(score=score)
    shifted.score_bias.copy_(router.score_bias + 0.125)   # exact in binary: the same sums' order
    moved = shifted(x)
    (moved.gates_NK * upstream).sum().backward()
    assert torch.equal(moved.experts_NK, out.experts_NK) and torch.equal(moved.gates_NK, out.gates_NK)
    assert torch.equal(shifted.w_gate.grad, got)


def test_padding_rows_are_routed_but_left_out_of_the_statistics():
    router = make_router(seq_balance_weight=0.5)
    x = randn(12, D)
    valid = torch.tensor([True] * 9 + [False] * 3)
    masked, real = router(x, valid_N=valid, seq_len=6), router(x[:9], seq_len=9)
    assert masked.experts_NK.shape == (12, K)
    torch.testing.assert_close(masked.load_E, real.load_E)
    torch.testing.assert_close(masked.importance_E, real.importance_E)
    # the second sequence has 3 real tokens of 6: the loss is the mean of two sequences' terms
    first = sequence_balance_sums(router.scores(x[:6] @ router.w_gate), masked.experts_NK[:6], 6)[0]
    second = sequence_balance_sums(router.scores(x[6:9] @ router.w_gate), masked.experts_NK[6:9], 3)[0]
    torch.testing.assert_close(masked.aux_loss, 0.5 * (first + second) / 2)


# ---------------------------------------------------------------- the bias update


def test_the_update_against_a_hand_loop_with_micro_batches_and_only_training_forwards():
    """b_i += u·sign(mean load - load_i) per step, the load summed over the step's micro-batches; eval forwards
    and forwards before begin_step (MAE's G step) do not count; nothing changes before after_step."""
    u = 0.01
    router = make_router(bias_update_rate=u)
    bias = [0.0] * E
    for step in range(6):
        router.train()
        before = router.score_bias.clone()
        router(randn(16, D, seed=100 + step))           # before begin_step: forgotten
        router.begin_step()
        load = [0.0] * E
        for micro in range(3):
            out = router(randn(20, D, seed=10 * step + micro))
            for e in out.experts_NK.reshape(-1).tolist():
                load[e] += 1
        router.eval()
        router(randn(20, D, seed=999))                  # evaluation: not a training forward
        assert torch.equal(router.score_bias, before)   # applied only by after_step
        router.after_step()
        mean = sum(load) / E
        bias = [b + u * ((mean > n) - (mean < n)) for b, n in zip(bias, load)]
        assert router.score_bias.tolist() == pytest.approx(bias, abs=1e-7), step
    assert len({round(b, 6) for b in bias}) > 1
    router.after_step()                                 # a step without training forwards changes nothing
    assert router.score_bias.tolist() == pytest.approx(bias, abs=1e-7)


def test_a_zero_rate_leaves_the_bias_at_zero():
    router = make_router(bias_update_rate=0.0)
    router(randn(20, D))
    router.after_step()
    assert torch.count_nonzero(router.score_bias) == 0


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_a_skewed_router_balances_without_any_auxiliary_loss(score):
    """Inputs whose mean direction sends most tokens to experts 0 and 1 (load CV 1.5 at the start), the router
    frozen, no loss at all: with u = 0.003 the bias alone brings the load of steps 150-250 (512 tokens each) to a
    CV below 0.1 (sigmoid: every one of those steps below 0.25); with u = 0 it stays above 1.4."""
    cvs, windows = {}, {}
    for u in (0.0, 0.003):
        torch.manual_seed(0)
        router = AuxFreeRouter(16, 8, 2, score=score, bias_update_rate=u)
        with torch.no_grad():
            router.w_gate.copy_(torch.randn(16, 8) * 0.3)
            router.w_gate[0] = torch.tensor([2.0, 1.5, 0, 0, -1, -1, -1, -1])
        gen, mean = torch.Generator().manual_seed(1), torch.zeros(16)
        mean[0] = 2.0
        cv, loads = [], []
        for _ in range(250):
            with torch.no_grad():
                out = router(torch.randn(512, 16, generator=gen) + mean)
            assert out.aux_loss.item() == 0
            cv.append(float(cv_squared(out.load_E).sqrt()))
            loads.append(out.load_E)
            router.after_step()
        cvs[u], windows[u] = cv, float(cv_squared(torch.stack(loads[150:]).sum(0)).sqrt())
    assert cvs[0.003][0] > 1.4 and windows[0.0] > 1.4
    assert windows[0.003] < 0.1
    if score == "sigmoid":
        assert max(cvs[0.003][150:]) < 0.25


def test_the_bias_stays_float32_when_the_model_is_cast_to_half_precision():
    router = make_router()
    router.score_bias.copy_(torch.tensor([0.3001, -0.2, 0.0, 0.25, -0.4, 0.1]))
    kept = router.score_bias.clone()
    router.bfloat16()
    assert router.w_gate.dtype == torch.bfloat16 and router.score_bias.dtype == torch.float32
    assert torch.equal(router.score_bias, kept)
    router.after_step()   # nothing pending
    router.double()
    assert router.score_bias.dtype == torch.float64   # wider casts (gradcheck's float64) are kept


def test_the_bias_round_trips_through_the_state_dict():
    router = make_router(bias_update_rate=0.01)
    for step in range(3):
        router(randn(20, D, seed=step))
        router.after_step()
    fresh = make_router(seed=5)
    fresh.load_state_dict(router.state_dict())
    assert torch.equal(fresh.score_bias, router.score_bias) and torch.count_nonzero(fresh.score_bias) > 0


# ---------------------------------------------------------------- the sequence-wise balance loss


def test_sequence_balance_loss_by_hand():
    """DeepSeek-V3 eq. 17-20 per sequence, averaged over the sequences: f_i = E/(K T)·#chosen, P_i = mean of
    s_i / Σ_j s_j."""
    router = make_router(seq_balance_weight=0.3)
    x = randn(4 * 5, D)
    out = router(x, seq_len=5)
    scores = torch.sigmoid(x @ router.w_gate.detach())
    terms = []
    for b in range(4):
        rows = range(5 * b, 5 * b + 5)
        f = [E / (K * 5) * sum(e in out.experts_NK[t].tolist() for t in rows) for e in range(E)]
        p = [sum(float(scores[t, e] / scores[t].sum()) for t in rows) / 5 for e in range(E)]
        terms.append(sum(fi * pi for fi, pi in zip(f, p)))
    assert out.aux_loss.item() == pytest.approx(0.3 * sum(terms) / 4, rel=1e-5)
    assert out.metrics["seq_balance_loss"].item() == pytest.approx(sum(terms) / 4, rel=1e-5)
    whole = router(x)   # no seq_len: one sequence of every row
    assert whole.aux_loss.item() != pytest.approx(out.aux_loss.item(), rel=1e-4)


def test_sequence_balance_loss_gradient_matches_finite_differences():
    router = make_router(seq_balance_weight=1.0).double()
    x = randn(12, D).double()
    experts = router(x, seq_len=4).experts_NK
    router.w_gate.grad = None
    router(x, seq_len=4).aux_loss.backward()

    def loss(w):
        return sequence_balance_sums(torch.sigmoid(x @ w), experts, 4)[0] / 3

    torch.testing.assert_close(router.w_gate.grad, torch.autograd.functional.jacobian(loss, router.w_gate.detach()))
    assert torch.count_nonzero(router.w_gate.grad) > 0


def test_batch_sum_is_called_once_even_without_tokens():
    calls = []
    router = make_router(seq_balance_weight=0.1)
    router.connect(SumWith(lambda t: calls.append(t.shape) or t))
    router(torch.zeros(0, D), seq_len=4)
    router(randn(8, D), seq_len=4)
    assert calls == [(2 * E + 2,), (2 * E + 2,)]


# ---------------------------------------------------------------- 2 ranks == 1 process


def _two_rank_worker(rank, world, score):
    import torch.distributed as dist

    from moe_scale.distributed.comm import BatchCollectives

    router = make_router(score=score, bias_update_rate=0.01, seq_balance_weight=0.2)
    router.connect(BatchCollectives(dist.group.WORLD))
    results = []
    for step in range(4):
        router.begin_step()
        for micro in range(2):
            x = randn(8 * 5, D, seed=10 * step + micro)
            shard = x[:15] if rank == 0 else x[15:]   # unequal shards of whole sequences of 5
            out = router(shard, seq_len=5)
            router.w_gate.grad = None
            out.aux_loss.backward()
            results.append(dict(aux=out.aux_loss.detach(), load=out.load_E, importance=out.importance_E.detach(),
                                experts=out.experts_NK, grad=router.w_gate.grad.clone()))
        router.after_step()
    return results, router.score_bias.clone()


@pytest.mark.multiprocess
@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_two_ranks_equal_one_process_on_the_concatenated_batch(score):
    (r0, bias0), (r1, bias1) = run_ranks(_two_rank_worker, world_size=2, args=(score,))
    router = make_router(score=score, bias_update_rate=0.01, seq_balance_weight=0.2)
    i = 0
    for step in range(4):
        router.begin_step()
        for micro in range(2):
            out = router(randn(8 * 5, D, seed=10 * step + micro), seq_len=5)
            router.w_gate.grad = None
            out.aux_loss.backward()
            for r in (r0[i], r1[i]):
                torch.testing.assert_close(r["aux"], out.aux_loss.detach())
                torch.testing.assert_close(r["load"], out.load_E)
                torch.testing.assert_close(r["importance"], out.importance_E.detach())
            torch.testing.assert_close(torch.cat([r0[i]["experts"], r1[i]["experts"]]), out.experts_NK)
            torch.testing.assert_close((r0[i]["grad"] + r1[i]["grad"]) / 2, router.w_gate.grad)
            i += 1
        router.after_step()
    assert torch.equal(bias0, router.score_bias) and torch.equal(bias1, router.score_bias)
    assert torch.count_nonzero(router.score_bias) > 0
    assert math.isfinite(router.score_bias.sum().item())
