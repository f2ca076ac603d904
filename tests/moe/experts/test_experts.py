"""GroupedExperts and its fused FFN autograd function, against per-expert slice references; the grouped-GEMM
(whole and split into calls of a few experts) and native kernels against the loop kernel; the kernel choice;
recompute on/off. (The native kernels' own edge cases: tests/moe/test_cpu_kernels.py.)"""

import math
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from moe_scale.moe.cpu_backend import kernels as cpu_kernels
from moe_scale.moe.experts import grouped_gemm
from moe_scale.moe.experts import GroupedExperts, expert_ffn, grouped_matmul
from moe_scale.moe.expert_counts import BlockCounts, ExpertCounts
from moe_scale.moe.experts.grouped_gemm import GroupLayout, kernel_for, per_expert_outer, rows_times_expert
from moe_scale.moe.kernel_policy import KernelPolicy, forced_policy

NATIVE_BUILT = cpu_kernels.available(torch.empty(0))
needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="native kernels not built (no C compiler?)")

COUNTS = {
    "all_nonzero": [3, 1, 5, 2],
    "zeros_inside_and_at_ends": [0, 4, 0, 0, 7, 0],
    "one_expert_gets_all": [0, 0, 9, 0],
    "single_expert": [6],
    "no_tokens_at_all": [0, 0, 0],
}


def reference_ffn(x, w_in, w_out, counts, scale):
    """relu(x[rows of e] @ w_in[e].T) @ w_out[e] * scale with plain autograd, expert by expert."""
    bounds = [0] + torch.tensor(counts).cumsum(0).tolist()
    pieces = [torch.relu(x[a:b] @ w_in[e].t()) @ w_out[e] * scale
              for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return torch.cat(pieces) if pieces else x.new_zeros(0, w_out.shape[2])


def _split_calls(max_groups: int):
    """Grouped GEMMs of at most `max_groups` experts per call (the GPU's 1,023, made small)."""
    return forced_policy(KernelPolicy(native_cpu=False, gate_chunk_rows=None, max_groups=max_groups))


@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
def test_grouped_native_and_loop_kernels_give_the_same_products(counts):
    gen = torch.Generator().manual_seed(len(counts) * 100 + sum(counts))
    m, e = sum(counts), len(counts)
    a = torch.randn(m, 8, generator=gen)
    b = torch.randn(e, 8, 12, generator=gen)
    g = torch.randn(m, 12, generator=gen)
    loop_layout = GroupLayout(counts, a, "loop")
    loop = rows_times_expert(a, b, loop_layout)
    outer_loop = per_expert_outer(a, g, loop_layout)
    b_t = torch.randn(e, 12, 8, generator=gen).transpose(1, 2)   # a weight's transpose (native's other kernel)
    loop_t = rows_times_expert(a, b_t, loop_layout)
    for kernel in ("grouped",) + (("native",) if NATIVE_BUILT else ()):
        layout = GroupLayout(counts, a, kernel)
        torch.testing.assert_close(rows_times_expert(a, b, layout), loop)
        torch.testing.assert_close(rows_times_expert(a, b_t, layout), loop_t)
        torch.testing.assert_close(per_expert_outer(a, g, layout), outer_loop)
    for max_groups in (1, 2, 3):   # several calls: chunk edges must not lose or shift rows
        with _split_calls(max_groups):
            layout = GroupLayout(torch.tensor(counts), a)
            assert layout.kernel == "grouped" and (layout.chunks is not None) == (e > max_groups)
            torch.testing.assert_close(rows_times_expert(a, b, layout), loop)
            torch.testing.assert_close(per_expert_outer(a, g, layout), outer_loop)
    if e % 2 == 0:   # only the rows per block of 2 experts on the host (the hierarchical gate's groups)
        blocks = BlockCounts(2, [counts[i] + counts[i + 1] for i in range(0, e, 2)])
        for max_groups in (2, 3, 4):
            with _split_calls(max_groups):
                layout = GroupLayout(ExpertCounts(torch.tensor(counts), blocks=blocks), a)
                assert layout._host_counts is None or e <= max_groups   # split at block edges without a read
                torch.testing.assert_close(rows_times_expert(a, b, layout), loop)
                torch.testing.assert_close(per_expert_outer(a, g, layout), outer_loop)
    start = 0
    for expert, count in enumerate(counts):        # against slices, and exact zeros for an empty expert
        torch.testing.assert_close(loop[start:start + count], a[start:start + count] @ b[expert])
        torch.testing.assert_close(outer_loop[expert], a[start:start + count].t() @ g[start:start + count])
        if count == 0:
            assert torch.count_nonzero(outer_loop[expert]) == 0
        start += count


@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
@pytest.mark.parametrize("dtype, kernel", [(torch.float64, "loop"), (torch.float32, "grouped"),
                                           pytest.param(torch.float32, "native", marks=needs_native),
                                           (torch.float32, None)],
                         ids=["loop_f64", "grouped_f32", "native_f32", "chosen_f32"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_expert_ffn_matches_per_expert_autograd(counts, dtype, kernel, recompute):
    gen = torch.Generator().manual_seed(len(counts) * 7 + sum(counts))
    m, e, d, h = sum(counts), len(counts), 8, 12
    x = torch.randn(m, d, generator=gen, dtype=dtype, requires_grad=True)
    w_in = torch.randn(e, h, d, generator=gen, dtype=dtype, requires_grad=True)
    w_out = torch.randn(e, h, d, generator=gen, dtype=dtype, requires_grad=True)
    grad_t = torch.randn(d, m, generator=gen, dtype=dtype)     # .t(): a non-contiguous upstream gradient
    y = expert_ffn(x, w_in, w_out, counts, scale=0.5, recompute=recompute, kernel=kernel)
    ref = reference_ffn(x, w_in, w_out, counts, 0.5)
    torch.testing.assert_close(y, ref)
    if m == 0:
        return
    got = torch.autograd.grad(y, (x, w_in, w_out), grad_t.t())
    want = torch.autograd.grad(ref, (x, w_in, w_out), grad_t.t(), allow_unused=True)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, torch.zeros_like(g) if r is None else r)
    for expert, count in enumerate(counts):
        if count == 0:
            assert torch.count_nonzero(got[1][expert]) == 0 and torch.count_nonzero(got[2][expert]) == 0


@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
@pytest.mark.parametrize("dtype, kernel", [(torch.float64, "loop"), (torch.float32, "grouped"),
                                           pytest.param(torch.float32, "native", marks=needs_native)],
                         ids=["loop_f64", "grouped_f32", "native_f32"])
def test_grouped_matmul_matches_per_expert_slices(counts, dtype, kernel):
    gen = torch.Generator().manual_seed(len(counts) * 3 + sum(counts))
    m, e = sum(counts), len(counts)
    x = torch.randn(m, 8, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(e, 8, 12, generator=gen, dtype=dtype, requires_grad=True)
    bounds = [0] + torch.tensor(counts).cumsum(0).tolist()
    ref = torch.cat([x[a:b] @ w[i] for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])
    out = grouped_matmul(x, w, counts, kernel)
    torch.testing.assert_close(out, ref)
    if m:
        grad = torch.randn(m, 12, generator=gen, dtype=dtype)
        for g, r in zip(torch.autograd.grad(out, (x, w), grad),
                        torch.autograd.grad(ref, (x, w), grad, allow_unused=True)):
            torch.testing.assert_close(g, torch.zeros_like(g) if r is None else r)
    if dtype == torch.float64 and m:
        assert torch.autograd.gradcheck(lambda a, b: grouped_matmul(a, b, counts, kernel), (x, w))


def test_expert_ffn_gradcheck_and_single_input_grad():
    counts = [2, 0, 3]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w_in = torch.randn(3, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(3, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    for recompute in (False, True):
        for kernel in ("loop",):
            assert torch.autograd.gradcheck(lambda a, b, c: expert_ffn(a, b, c, counts, scale=1.5,
                                                                       recompute=recompute, kernel=kernel),
                                            (x, w_in, w_out))
    # Only one input needs a gradient: the other branches must be skipped, not crash.
    ref = reference_ffn(x, w_in, w_out, counts, 1.0).sum()
    want_x, want_w_out = torch.autograd.grad(ref, (x, w_out))
    for kernel in ("loop",):   # float64: grouped GEMM takes float32/16 only
        (gx,) = torch.autograd.grad(expert_ffn(x, w_in.detach(), w_out.detach(), counts, kernel=kernel).sum(), x)
        (gw,) = torch.autograd.grad(expert_ffn(x.detach(), w_in.detach(), w_out, counts, kernel=kernel).sum(), w_out)
        torch.testing.assert_close(gx, want_x)
        torch.testing.assert_close(gw, want_w_out)


@needs_native
def test_kernel_choice_native_for_every_row_count_in_float32():
    """CPU float32: native kernels for every product, with few rows per expert, with many, and with none."""
    f32 = torch.empty(0)
    for counts in ([0, 3, 0, 0, 1, 0, 0, 0], [1000] * 4, [0, 0]):
        assert GroupLayout(counts, f32).kernel == "native"
    assert GroupLayout([3, 1], torch.empty(0, dtype=torch.bfloat16)).kernel == "grouped"   # float32 only
    with _split_calls(1023):   # what a GPU decides: no native kernels
        assert GroupLayout([3, 1], f32).kernel == "grouped"


def test_kernel_choice_without_native(monkeypatch):
    f32, f64, bf16 = torch.empty(0), torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.bfloat16)
    assert GroupLayout([3, 1], bf16).kernel == "grouped"
    grouped_gemm._warn_loop.cache_clear()
    with pytest.warns(UserWarning, match="one matmul per group on cpu float64; grouped GEMMs take float32, "
                                         "bfloat16 and float16: train in one of those"):
        assert GroupLayout([33, 1], f64).kernel == "loop"
    with pytest.raises(ValueError, match="kernel must be one of"):
        GroupLayout([1], f32, kernel="fast")
    with pytest.raises(ValueError, match="kernel 'native' takes CPU float32"):
        GroupLayout([1], f64, kernel="native")
    monkeypatch.setattr(cpu_kernels, "available", lambda like: False)   # float32 where no library was built
    assert GroupLayout([0, 3, 0, 0, 1, 0, 0, 0], f32).kernel == "grouped"


@pytest.mark.parametrize("device, dtype, capability, has_grouped_mm, has_triton, want", [
    ("cuda", torch.bfloat16, (9, 0), True, True, "grouped"),      # H100 / H200: the CUTLASS kernel
    ("cuda", torch.bfloat16, (10, 0), True, False, "grouped"),    # B200
    ("cuda", torch.bfloat16, (8, 0), True, True, "triton"),       # A100: torch would loop with a host sync
    ("cuda", torch.float32, (9, 0), True, True, "triton"),        # fp32 on an H100: TF32 in Triton
    ("cuda", torch.float16, (9, 0), True, True, "triton"),
    ("cuda", torch.float32, (8, 0), True, False, "loop"),         # nothing grouped left: warned
    ("cuda", torch.bfloat16, (9, 0), False, False, "loop"),       # an old torch without F.grouped_mm
    ("cpu", torch.bfloat16, None, True, False, "grouped"),
    ("cpu", torch.float16, None, True, False, "grouped"),
    ("cpu", torch.float64, None, True, True, "loop"),
])
def test_kernel_decision_table(device, dtype, capability, has_grouped_mm, has_triton, want):
    """What each device, dtype and GPU generation gets (the native CPU kernels aside)."""
    assert kernel_for(device, dtype, capability, has_grouped_mm, has_triton)[0] == want


def reference_gated(rows, w_in, w_out, counts, row_of_pair, gate, scale):
    """out[r] = sum over pairs m reading row r of gate[m] * expert(m)(rows[r]) * scale, plain autograd."""
    y = reference_ffn(rows[row_of_pair], w_in, w_out, counts, scale) * gate[:, None]
    return torch.zeros_like(rows).index_add(0, row_of_pair, y)


GATED = {  # counts per expert, and the row each pair reads (pairs sorted by expert)
    "two_pairs_share_rows": ([3, 2, 2], [0, 2, 3, 0, 1, 3, 2]),
    "row_nobody_reads": ([2, 0, 2], [0, 1, 3, 1]),
    "one_expert_gets_all": ([0, 4, 0], [3, 2, 1, 0]),
}


@pytest.mark.parametrize("counts, row_of_pair", GATED.values(), ids=GATED.keys())
@pytest.mark.parametrize("kernel", ["loop"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_gated_row_sums_match_reference_in_value_and_every_gradient(counts, row_of_pair, kernel, recompute):
    """The layer's form: pairs gather their rows, and gate-weighted outputs are summed per row; the gate's
    gradient comes from the backward's own product. float64 gradcheck plus a reference comparison."""
    gen = torch.Generator().manual_seed(sum(counts) + len(row_of_pair))
    d, h, e = 3, 5, len(counts)
    rows = torch.randn(4, d, generator=gen, dtype=torch.float64, requires_grad=True)
    w_in = torch.randn(e, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(e, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
    gate = torch.rand(len(row_of_pair), generator=gen, dtype=torch.float64).add_(0.1).requires_grad_(True)
    index = torch.tensor(row_of_pair)

    def gated(r, a, b, g):
        return expert_ffn(r, a, b, counts, index, g, scale=0.7, recompute=recompute, kernel=kernel)

    torch.testing.assert_close(gated(rows, w_in, w_out, gate),
                               reference_gated(rows, w_in, w_out, counts, index, gate, 0.7))
    assert torch.autograd.gradcheck(gated, (rows, w_in, w_out, gate))


# Rows per expert through each of the native kernels' paths (dot products, a tile, panels, several items).
_MANY = [3, 12, 20, 130, 0]
GATED_NATIVE = {**GATED, "every_kernel_path": (
    _MANY, torch.randint(0, 60, (sum(_MANY),), generator=torch.Generator().manual_seed(0)).tolist())}


@needs_native
@pytest.mark.parametrize("counts, row_of_pair", GATED_NATIVE.values(), ids=GATED_NATIVE.keys())
def test_gated_row_sums_native_float32_match_reference(counts, row_of_pair):
    """The native kernels take float32 only (no gradcheck): value and every gradient against the reference."""
    gen = torch.Generator().manual_seed(len(row_of_pair))
    d, h, e = 20, 36, len(counts)
    leaves = [torch.randn(max(row_of_pair) + 1, d, generator=gen), torch.randn(e, h, d, generator=gen),
              torch.randn(e, h, d, generator=gen), torch.rand(len(row_of_pair), generator=gen) + 0.1]
    index, grad = torch.tensor(row_of_pair), torch.randn(max(row_of_pair) + 1, d, generator=gen)
    outs = []
    for run in (lambda r, a, b, g: expert_ffn(r, a, b, counts, index, g, scale=0.7, kernel="native"),
                lambda r, a, b, g: reference_gated(r, a, b, counts, index, g, 0.7)):
        inputs = [t.clone().requires_grad_(True) for t in leaves]
        out = run(*inputs)
        outs.append((out, *torch.autograd.grad(out, inputs, grad)))
    for got, want in zip(*outs):   # float32 sums in different orders: the gate gradient sums 720 products
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_gated_form_saves_no_per_pair_copy_of_inputs_or_outputs():
    """Memory: the gated form saves the rows, the hidden layer, indices and gates; no [M, D] tensor (neither
    the gathered inputs nor the outputs), where per-pair dispatch + combine would save two."""
    counts, d, h = [30, 34], 8, 16
    rows = torch.randn(40, d, requires_grad=True)
    row_of_pair = torch.randint(0, 40, (64,))
    gate = torch.rand(64, requires_grad=True)
    experts = GroupedExperts(2, d, h)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(tuple(t.shape)) or t, lambda t: t):
        out = experts(rows, counts, row_of_pair, gate)
    assert out.shape == (40, d)
    assert (64, d) not in sizes and (40, d) in sizes and (64, h) in sizes


def test_flop_counter_sees_the_grouped_gemm():
    """FlopCounterMode knows no formula for aten::_grouped_mm; grouped_gemm.py registers one. Forward + backward
    of the FFN is 3 x 2 matmuls of M x D x H multiply-adds (2 FLOPs each)."""
    from torch.utils.flop_counter import FlopCounterMode

    counts, d, h = [5, 0, 7, 4], 8, 24
    x = torch.randn(sum(counts), d, requires_grad=True)
    w_in = torch.randn(4, h, d, requires_grad=True)
    w_out = torch.randn(4, h, d, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        expert_ffn(x, w_in, w_out, counts, kernel="grouped").sum().backward()
    assert counter.get_total_flops() == 3 * 2 * 2 * sum(counts) * d * h


@pytest.mark.parametrize("activation, hidden", [("relu", 256), ("swiglu", 128)])   # first layer 256 wide either way
def test_recompute_keeps_no_hidden_activations(activation, hidden):
    """App. D: with recompute the function saves x and the weights, never the first layer's [M, 256] output."""
    counts = [40, 24]
    experts = GroupedExperts(2, 8, hidden, recompute=True, activation=activation)
    x = torch.randn(64, 8, requires_grad=True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(tuple(t.shape)) or t, lambda t: t):
        experts(x, counts)
    assert (64, 256) not in sizes and (64, 8) in sizes
    experts.recompute, sizes = False, []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(tuple(t.shape)) or t, lambda t: t):
        experts(x, counts)
    assert (64, 256) in sizes


def reference_experts(experts, x_MD, counts):
    """relu(x @ w_in[e].T) @ w_out[e] * sqrt(D/H), expert by expert."""
    out, start = [], 0
    for e, count in enumerate(counts):
        rows = x_MD[start:start + count]
        out.append(torch.relu(rows @ experts.w_in[e].t()) @ experts.w_out[e]
                   * math.sqrt(experts.d_model / experts.d_hidden))
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
    assert experts.w_in.shape == (4, 32, 16) and experts.w_out.shape == (4, 32, 16)   # w_in as nn.Linear: (out, in)
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


def _experts_and_batch(reuse: bool, seed: int = 4):
    """Few rows per expert in float32: the native kernels, where gradient buffers are reused."""
    counts = [2, 0, 3, 1, 4, 0, 2, 1]
    experts = GroupedExperts(len(counts), 32, 48, seed=seed, reuse_grad_buffers=reuse)
    x = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(seed))
    return experts, x, counts


def _weight_grads(experts, x, counts, scale: float = 1.0):
    (experts(x, counts) * scale).sum().backward()
    return experts.w_in.grad, experts.w_out.grad


@needs_native
def test_cleared_gradients_are_rewritten_in_the_same_memory_with_the_right_values():
    experts, x, counts = _experts_and_batch(reuse=True)
    reference, _, _ = _experts_and_batch(reuse=False)
    first = _weight_grads(experts, x, counts)
    pointers = [g.data_ptr() for g in first]
    want = [g.clone() for g in first]
    experts.zero_grad(set_to_none=True)
    del first
    second = _weight_grads(experts, x, counts, scale=3.0)
    assert [g.data_ptr() for g in second] == pointers                  # adopted as .grad, no copy
    for got, single in zip(second, want):
        torch.testing.assert_close(got, 3.0 * single)
    for got, ref in zip(second, _weight_grads(reference, x, counts, scale=3.0)):
        torch.testing.assert_close(got, ref)


@needs_native
def test_a_gradient_still_held_is_never_written_over():
    """Kept .grad (accumulation across backwards) and a gradient the caller took away must both survive."""
    experts, x, counts = _experts_and_batch(reuse=True)
    once = [g.clone() for g in _weight_grads(experts, x, counts)]
    accumulated = _weight_grads(experts, x, counts, scale=2.0)         # .grad not cleared: 1x + 2x
    for got, single in zip(accumulated, once):
        torch.testing.assert_close(got, 3.0 * single)
    taken = experts.w_in.grad
    experts.zero_grad(set_to_none=True)
    _weight_grads(experts, x, counts, scale=-5.0)
    torch.testing.assert_close(taken, 3.0 * once[0])                   # still the caller's values
    assert experts.w_in.grad.data_ptr() != taken.data_ptr()
    torch.testing.assert_close(experts.w_in.grad, -5.0 * once[0])


@needs_native
def test_two_calls_in_one_graph_sum_their_gradients():
    experts, x, counts = _experts_and_batch(reuse=True)
    reference, _, _ = _experts_and_batch(reuse=False)
    for module in (experts, reference):
        for _ in range(2):   # a second step: the kept buffers are free and get taken by the first call
            module.zero_grad(set_to_none=True)
            (module(x, counts).sum() + 2.0 * module(x * 0.5, counts).sum()).backward()
    torch.testing.assert_close(experts.w_in.grad, reference.w_in.grad)
    torch.testing.assert_close(experts.w_out.grad, reference.w_out.grad)
