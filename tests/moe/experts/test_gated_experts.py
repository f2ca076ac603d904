"""Gated experts (moe/experts/kinds.py: SwiGLU, GeGLU; GroupedExperts(activation=...)): value and every gradient
against transformers' MixtralExperts loop transcribed expert by expert (act(x W1ᵀ) * x W3ᵀ) W2ᵀ, with torch's silu
or (erf) gelu, on every kernel, per pair and in the gated row-sum form, with and without recompute; float64
gradcheck; the weights' gradients written into the kept buffers; initialisation independent of the expert-parallel
layout; the ReLU experts unchanged."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from moe_scale.moe.cpu_backend import kernels as cpu_kernels
from moe_scale.moe.experts import GroupedExperts, expert_ffn

NATIVE_BUILT = cpu_kernels.available(torch.empty(0))
KERNELS = [(torch.float64, "loop"), (torch.float32, "grouped"),
           pytest.param(torch.float32, "native", marks=pytest.mark.skipif(not NATIVE_BUILT, reason="no C compiler")),
           (torch.float32, None)]
KERNEL_IDS = ["loop_f64", "grouped_f32", "native_f32", "chosen_f32"]
GATED = {  # counts per expert, and the row each pair reads (pairs sorted by expert)
    "two_pairs_share_rows": ([3, 2, 2], [0, 2, 3, 0, 1, 3, 2]),
    "row_nobody_reads": ([2, 0, 2], [0, 1, 3, 1]),
    "one_expert_gets_all": ([0, 4, 0], [3, 2, 1, 0]),
    "many_rows": ([3, 12, 20, 41, 0], torch.randint(0, 30, (76,), generator=torch.Generator().manual_seed(0)).tolist()),
}


ACTS = {"swiglu": torch.nn.functional.silu, "geglu": torch.nn.functional.gelu}   # transformers' "silu", "gelu"


def mixtral_reference(rows, w_in, w_out, counts, row_of_pair=None, gate=None, scale=1.0, kind="swiglu"):
    """MixtralExperts.forward's arithmetic, one expert at a time: gate/up from w_in's two halves (w1, w3), down
    through w_out (w2ᵀ), times the pair's gate, summed per row."""
    f = w_out.shape[1]
    x = rows if row_of_pair is None else rows[row_of_pair]
    bounds = [0] + torch.tensor(counts).cumsum(0).tolist()
    pieces = []
    for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        w1, w3, w2 = w_in[e, :f], w_in[e, f:], w_out[e].t()
        pieces.append(torch.nn.functional.linear(ACTS[kind](x[a:b] @ w1.t()) * (x[a:b] @ w3.t()), w2))
    y = torch.cat(pieces) * scale if pieces else x.new_zeros(0, w_out.shape[2])
    if gate is None:
        return y
    y = y * gate[:, None]
    return y.new_zeros(rows.shape).index_add(0, row_of_pair, y)


def _leaves(counts, rows, d, f, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    e = len(counts)
    return [torch.randn(rows, d, generator=gen, dtype=dtype), torch.randn(e, 2 * f, d, generator=gen, dtype=dtype),
            torch.randn(e, f, d, generator=gen, dtype=dtype)]


@pytest.mark.parametrize("kind", ACTS)
@pytest.mark.parametrize("case", GATED, ids=GATED.keys())
@pytest.mark.parametrize("dtype, kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_gated_row_sums_match_mixtrals_experts_in_value_and_every_gradient(case, dtype, kernel, recompute, kind):
    counts, row_of_pair = GATED[case]
    index = torch.tensor(row_of_pair)
    rows, w_in, w_out = _leaves(counts, max(row_of_pair) + 1, 12, 20, dtype, len(row_of_pair))
    gate = torch.rand(len(row_of_pair), generator=torch.Generator().manual_seed(5), dtype=dtype) + 0.1
    grad = torch.randn(rows.shape, generator=torch.Generator().manual_seed(6), dtype=dtype)
    results = []
    for run in (lambda r, a, b, g: expert_ffn(r, a, b, counts, index, g, scale=0.7, recompute=recompute,
                                              kernel=kernel, kind=kind),
                lambda r, a, b, g: mixtral_reference(r, a, b, counts, index, g, 0.7, kind)):
        inputs = [t.clone().requires_grad_(True) for t in (rows, w_in, w_out, gate)]
        out = run(*inputs)
        results.append((out, *torch.autograd.grad(out, inputs, grad)))
    tolerance = {} if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("kind", ACTS)
@pytest.mark.parametrize("dtype, kernel", KERNELS, ids=KERNEL_IDS)
def test_per_pair_form_matches_and_an_expert_without_rows_gets_exact_zero_gradients(dtype, kernel, kind):
    counts = [0, 4, 0, 7, 0]
    x, w_in, w_out = (t.requires_grad_(True) for t in _leaves(counts, 11, 8, 12, dtype, 3))
    y = expert_ffn(x, w_in, w_out, counts, scale=1.0, kernel=kernel, kind=kind)
    ref = mixtral_reference(x, w_in, w_out, counts, kind=kind)
    torch.testing.assert_close(y, ref)
    upstream = torch.randn(8, 11, dtype=dtype).t()   # a non-contiguous upstream gradient
    got = torch.autograd.grad(y, (x, w_in, w_out), upstream)
    want = torch.autograd.grad(ref, (x, w_in, w_out), upstream)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, **({} if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)))
    for expert in (0, 2, 4):
        assert torch.count_nonzero(got[1][expert]) == 0 and torch.count_nonzero(got[2][expert]) == 0


@pytest.mark.parametrize("kind", ACTS)
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_gradcheck(recompute, kind):
    counts, index = [2, 0, 3], torch.tensor([0, 3, 1, 2, 0])
    leaves = _leaves(counts, 4, 3, 4, torch.float64, 0)
    gate = torch.rand(5, dtype=torch.float64) + 0.1
    inputs = [t.requires_grad_(True) for t in (*leaves, gate)]
    assert torch.autograd.gradcheck(lambda r, a, b, g: expert_ffn(r, a, b, counts, index, g, scale=1.5,
                                                                  recompute=recompute, kernel="loop", kind=kind),
                                    inputs)


@pytest.mark.parametrize("kind", ACTS)
def test_grouped_experts_shapes_scale_init_and_layout_independence(kind):
    experts = GroupedExperts(4, 16, 24, seed=3, activation=kind)
    assert experts.w_in.shape == (4, 48, 16) and experts.w_out.shape == (4, 24, 16)
    assert experts.output_scale == 1.0
    assert experts.w_in.std().item() == pytest.approx(0.02, rel=0.1)
    assert experts.w_out.std().item() == pytest.approx(0.02, rel=0.1)
    half = GroupedExperts(2, 16, 24, first_global_expert=2, seed=3, activation=kind)   # rank 1 of 2
    assert torch.equal(half.w_in, experts.w_in[2:]) and torch.equal(half.w_out, experts.w_out[2:])
    x = torch.randn(10, 16)
    torch.testing.assert_close(experts(x, [3, 3, 0, 4]), mixtral_reference(x, experts.w_in, experts.w_out,
                                                                            [3, 3, 0, 4], kind=kind))
    relu = GroupedExperts(4, 16, 24, seed=3)
    assert relu.activation == "relu" and relu.w_in.shape == (4, 24, 16)
    with pytest.raises(ValueError, match="expert kind must be one of"):
        GroupedExperts(4, 16, 24, activation="gelu")


@pytest.mark.skipif(not NATIVE_BUILT, reason="no C compiler")
def test_cleared_gradients_are_rewritten_in_the_same_memory():
    counts = [5, 0, 9]
    experts = GroupedExperts(3, 16, 24, seed=1, activation="swiglu")
    x = torch.randn(14, 16)
    experts(x, counts).square().sum().backward()
    first = {name: (p.grad.data_ptr(), p.grad.clone()) for name, p in experts.named_parameters()}
    experts.zero_grad(set_to_none=True)
    experts(x, counts).square().sum().backward()
    for name, p in experts.named_parameters():
        assert p.grad.data_ptr() == first[name][0], name
        torch.testing.assert_close(p.grad, first[name][1])
