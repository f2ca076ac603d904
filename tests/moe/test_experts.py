"""GroupedExperts and the grouped-matmul autograd function, against per-expert slice references."""

import math
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from moe_scale.moe.experts import GroupedExperts, grouped_matmul


def reference_grouped_matmul(x_MI, w_EIO, tokens_per_expert):
    """Plain autograd: concatenate x[rows of e] @ w[e] over experts."""
    bounds = [0] + torch.tensor(tokens_per_expert).cumsum(0).tolist()
    pieces = [x_MI[a:b] @ w_EIO[e] for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return torch.cat(pieces) if pieces else x_MI.new_zeros(0, w_EIO.shape[2])


COUNTS = {
    "all_nonzero": [3, 1, 5, 2],
    "zeros_inside_and_at_ends": [0, 4, 0, 0, 7, 0],
    "one_expert_gets_all": [0, 0, 9, 0],
    "single_expert": [6],
    "no_tokens_at_all": [0, 0, 0],
}


@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
def test_grouped_matmul_matches_per_expert_slices(counts):
    gen = torch.Generator().manual_seed(len(counts) * 100 + sum(counts))
    m, e, i, o = sum(counts), len(counts), 8, 12
    x = torch.randn(m, i, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(e, i, o, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(m, o, generator=gen, dtype=torch.float64)

    out = grouped_matmul(x, w, counts)
    gx, gw = torch.autograd.grad(out, (x, w), grad_out)
    ref = reference_grouped_matmul(x, w, counts)
    ref_gx, ref_gw = torch.autograd.grad(ref, (x, w), grad_out, allow_unused=True)
    ref_gw = torch.zeros_like(w) if ref_gw is None else ref_gw   # M == 0: nothing reaches w

    assert out.shape == (m, o)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, ref_gx if ref_gx is not None else torch.zeros_like(x))
    torch.testing.assert_close(gw, ref_gw)
    # An expert with no tokens gets an exact zero gradient (not uninitialised memory).
    for expert, count in enumerate(counts):
        if count == 0:
            assert torch.count_nonzero(gw[expert]) == 0


def test_grouped_matmul_single_input_grad_and_gradcheck():
    counts = [2, 0, 3]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: grouped_matmul(a, b, counts), (x, w))
    # Only one of the inputs needs a gradient: the other branch must be skipped, not crash.
    (gx,) = torch.autograd.grad(grouped_matmul(x, w.detach(), counts).sum(), x)
    (gw,) = torch.autograd.grad(grouped_matmul(x.detach(), w, counts).sum(), w)
    torch.testing.assert_close(gx, torch.autograd.grad(reference_grouped_matmul(x, w, counts).sum(), x)[0])
    torch.testing.assert_close(gw, torch.autograd.grad(reference_grouped_matmul(x, w, counts).sum(), w)[0])


def test_grouped_matmul_non_contiguous_upstream_grad():
    counts = [2, 3]
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    grad_t = torch.randn(6, 5, dtype=torch.float64)          # .t() gives a non-contiguous [5, 6] gradient
    gx, gw = torch.autograd.grad(grouped_matmul(x, w, counts), (x, w), grad_t.t())
    rx, rw = torch.autograd.grad(reference_grouped_matmul(x, w, counts), (x, w), grad_t.t())
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


def reference_experts(experts, x_MD, counts):
    """relu(x @ w_in[e]) @ w_out[e] * sqrt(D/H), expert by expert."""
    out, start = [], 0
    for e, count in enumerate(counts):
        rows = x_MD[start:start + count]
        out.append(torch.relu(rows @ experts.w_in[e]) @ experts.w_out[e] * math.sqrt(experts.d_model / experts.d_hidden))
        start += count
    return torch.cat(out)


@pytest.mark.parametrize("counts", [[4, 0, 7, 1, 0, 3], [0, 0, 0, 0, 0, 0]], ids=["mixed", "empty"])
def test_grouped_experts_forward_backward_match_reference(counts):
    d, h = 8, 24
    experts = GroupedExperts(len(counts), d, h, seed=3).double()
    x = torch.randn(sum(counts), d, dtype=torch.float64, requires_grad=True)
    y = experts(x, counts)
    ref = reference_experts(experts, x, counts)
    assert y.shape == (sum(counts), d)
    torch.testing.assert_close(y, ref)
    if sum(counts) == 0:
        return
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, experts.w_in, experts.w_out), grad)
    want = torch.autograd.grad(ref, (x, experts.w_in, experts.w_out), grad)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


def test_grouped_experts_output_scale_and_shapes():
    experts = GroupedExperts(4, 16, 32)
    assert experts.w_in.shape == (4, 16, 32) and experts.w_out.shape == (4, 32, 16)
    assert experts.output_scale == pytest.approx(math.sqrt(16 / 32))
    bound = math.sqrt(6.0 / (16 + 32))                      # Glorot uniform per expert matrix
    for w in (experts.w_in, experts.w_out):
        assert w.abs().max() <= bound
        assert w.abs().max() > 0.9 * bound                  # really uses the range, not a tiny init
        assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.15)


def test_init_depends_on_global_expert_id_not_on_rank_layout():
    whole = GroupedExperts(8, 8, 16, first_global_expert=0, seed=11)
    for first in (0, 4):
        part = GroupedExperts(4, 8, 16, first_global_expert=first, seed=11)
        torch.testing.assert_close(part.w_in, whole.w_in[first:first + 4], rtol=0, atol=0)
        torch.testing.assert_close(part.w_out, whole.w_out[first:first + 4], rtol=0, atol=0)
    # Different experts, and w_in vs w_out of one expert, are not copies of each other.
    assert not torch.equal(whole.w_in[0], whole.w_in[1])
    assert not torch.equal(whole.w_in[0][:, :8], whole.w_out[0][:8, :])


def test_init_seed_matters_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = GroupedExperts(4, 8, 16, seed=0), GroupedExperts(4, 8, 16, seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(a.w_in, b.w_in)
    assert not torch.equal(a.w_out, b.w_out)
    # Seeds must not alias shifted expert ids: (seed 1, expert 0) differs from every expert of seed 0.
    c = GroupedExperts(16, 8, 16, seed=0)
    assert all(not torch.equal(b.w_in[0], c.w_in[j]) for j in range(16))
    torch.testing.assert_close(GroupedExperts(4, 8, 16, seed=1).w_in, b.w_in, rtol=0, atol=0)


def test_grouped_experts_under_autocast_match_bf16_reference():
    """Autocast does not reach inside a custom autograd Function: bf16 activations met fp32 weights and
    torch.mm(out=...) raised a dtype mismatch (DeepSpeed's `torch_autocast` runs the model this way)."""
    counts = [3, 0, 5, 2]
    experts = GroupedExperts(len(counts), 8, 16, seed=2)
    x = torch.randn(sum(counts), 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = experts(x.bfloat16(), counts)                       # what an autocast layer upstream hands over
        ref = reference_experts(experts, x, counts)             # plain matmuls, cast by autocast itself
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref)
    y.float().sum().backward()
    assert experts.w_in.grad.dtype == torch.float32 and torch.count_nonzero(experts.w_in.grad[0]) > 0
