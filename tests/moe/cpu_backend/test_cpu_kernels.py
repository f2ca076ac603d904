"""The native CPU expert kernels (moe/cpu_backend/cpu_kernels.c) against per-expert float64 products at the shapes where
their code paths split: rows_times_wt's three kernels (dot products for <= LANES rows, in one group of rows
up to LANES/2 and two beyond, with 2 or 4 rows of W at a time; transposed tiles for blocks of LANES rows where
LANES < 16; transposed W panels from 17 rows, 16 with narrower vectors), rows_times_w's row blocks and passes
over W, rows_outer's passes over many rows; items of at most 96 rows, empty experts, column tails of every
vector and tile width, gathered rows (a row index) and the fused ReLU; narrower vectors (built for AVX2 and
plain x86-64); thread counts; streaming stores; and their build: cached per source and CPU, one warning and
torch's ops when no compiler works or the library does not load. (The gate's kernel, cpu_gating.c:
tests/moe/test_gating_ops.py.)"""

import ctypes
import os
import platform
import subprocess
import sys

import pytest
import torch

from moe_scale.moe.cpu_backend import kernels as cpu_kernels
from tests.paths import REPO

pytestmark = pytest.mark.skipif(not cpu_kernels.available(torch.empty(0)),
                                reason="native kernels not built (see the warning); torch's GEMMs are used")

# Rows per expert on both sides of every split: dot products with AVX-512 for 1-2 and 5-8 rows (2 rows of W at a
# time), 3-4 (4 rows of W), 9-16 (two groups); with AVX 1-4, 5-8 (two groups) and 9-15 (a transposed tile, then
# dot products); 16/17-19 (panels), 97 and 200 (items of at most 96 rows), 200 and 400 (rows_outer in passes: at
# most 384 rows, fewer for wide rows, e.g. 120 of 256 columns), and experts with none.
COUNTS = [0, 1, 2, 3, 4, 5, 0, 6, 8, 9, 0, 10, 11, 12, 15, 16, 17, 19, 33, 97, 200, 0, 400]


def _offsets(counts):
    return torch.tensor([0] + counts).cumsum(0)


def _per_expert(counts, product):
    """Concatenates product(expert, row slice) over the experts."""
    bounds = _offsets(counts).tolist()
    return [product(e, slice(bounds[e], bounds[e + 1])) for e in range(len(counts))]


@pytest.mark.parametrize("n, k", [(5, 1), (7, 15), (16, 16), (33, 17), (64, 64), (40, 130), (512, 256), (3, 200)])
def test_products_match_per_expert_torch_at_every_width_and_block_edge(n, k):
    _check_products(n, k)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":")[1].split()) for line in f if line.startswith("flags")), set())


NARROWER_TARGETS = {"avx2": ("-march=x86-64", "-mavx2", "-mfma"), "sse2": ("-march=x86-64",)}


@pytest.mark.skipif(platform.machine() != "x86_64" or not os.path.exists("/proc/cpuinfo"), reason="x86-64 Linux")
@pytest.mark.parametrize("target", NARROWER_TARGETS)
def test_kernels_built_for_narrower_vectors_give_the_same_products(target, tmp_path, monkeypatch):
    """The kernels' vectors are as wide as the target's registers (16 floats with AVX-512, 8 with AVX, else 4)
    and their tiles as large as its register file: built for AVX2 or plain x86-64, as on CPUs without AVX-512,
    they give the same products."""
    if target == "avx2" and not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2")
    flags = tuple(flag for flag in cpu_kernels._FLAGS if flag != "-march=native") + NARROWER_TARGETS[target]
    monkeypatch.setattr(cpu_kernels, "_FLAGS", flags)
    path = tmp_path / "kernels.so"
    assert cpu_kernels._build(os.environ.get("CC", "cc"), path) is None
    library = cpu_kernels._declare(ctypes.CDLL(str(path)))
    monkeypatch.setattr(cpu_kernels, "_library", lambda: library)
    for n, k in [(5, 1), (33, 17), (512, 256)]:
        _check_products(n, k)


def _check_products(n: int, k: int, counts: list[int] = COUNTS) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    m, e = sum(counts), len(counts)
    w = torch.randn(e, n, k, generator=gen)
    a_k, a_n = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
    sources = torch.randn(m + 5, k, generator=gen)                   # rows gathered through an index
    index = torch.randint(0, m + 5, (m,), generator=gen)
    offsets = _offsets(counts)
    close = dict(rtol=1e-5, atol=2e-4)   # float32 sums of up to 512 terms, against float64 products
    w64, a_k64, a_n64, gathered64 = w.double(), a_k.double(), a_n.double(), sources[index].double()

    def per_expert_wt(a64):
        return torch.cat(_per_expert(counts, lambda i, rows: a64[rows] @ w64[i].t()))

    torch.testing.assert_close(cpu_kernels.rows_times_wt(a_k, w, offsets).double(), per_expert_wt(a_k64), **close)
    torch.testing.assert_close(cpu_kernels.rows_times_wt(sources, w, offsets, index, relu=True).double(),
                               per_expert_wt(gathered64).clamp(min=0), **close)
    torch.testing.assert_close(cpu_kernels.rows_times_w(a_n, w, offsets).double(),
                               torch.cat(_per_expert(counts, lambda i, rows: a_n64[rows] @ w64[i])), **close)
    outer = cpu_kernels.rows_outer(a_n, a_k, offsets)
    torch.testing.assert_close(outer.double(),
                               torch.stack(_per_expert(counts, lambda i, rows: a_n64[rows].t() @ a_k64[rows])), **close)
    torch.testing.assert_close(cpu_kernels.rows_outer(a_n, sources, offsets, b_index_M=index).double(),
                               torch.stack(_per_expert(counts, lambda i, rows: a_n64[rows].t() @ gathered64[rows])),
                               **close)
    for expert in (i for i, count in enumerate(counts) if count == 0):   # no rows: exact zeros, not stale memory
        assert torch.count_nonzero(outer[expert]) == 0
    # Written over a buffer used before (streaming stores where vector-aligned): the same bits, stale
    # values gone, also when the buffer starts 4 bytes past an alignment boundary.
    misaligned = torch.empty(outer.numel() + 1)[1:].view(outer.shape)
    for buffer in (torch.full_like(outer, 7.0), misaligned.fill_(7.0)):
        assert cpu_kernels.rows_outer(a_n, a_k, offsets, buffer, True) is buffer
        assert torch.equal(buffer, outer)
    with pytest.raises(ValueError, match="out must be a contiguous float32"):
        cpu_kernels.rows_outer(a_n, a_k, offsets, outer.double(), True)


def test_relu_keeps_nan_and_zeroes_negatives_as_torch_does():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    w = torch.tensor([[[2.0, 0.0], [-3.0, 0.0], [float("nan"), 0.0]]])   # one expert, N = 3
    got = cpu_kernels.rows_times_wt(a, w, _offsets([3]), relu=True)
    torch.testing.assert_close(got, torch.relu(a @ w[0].t()), equal_nan=True)


def test_a_row_index_out_of_range_or_of_the_wrong_length_is_refused():
    a, w, offsets = torch.randn(4, 8), torch.randn(2, 3, 8), _offsets([2, 1])
    with pytest.raises(ValueError, match=r"row index must lie in \[0, 4\), got \[0, 4\]"):
        cpu_kernels.rows_times_wt(a, w, offsets, torch.tensor([0, 4, 1]))
    with pytest.raises(ValueError, match="row index must have 3 entries"):
        cpu_kernels.rows_outer(torch.randn(3, 3), a, offsets, b_index_M=torch.tensor([0, 1]))


def test_many_experts_give_the_same_bits_with_one_thread_or_two():
    """Work goes to threads in runs of experts; each output is computed by one thread in a fixed order, so
    the thread count must not change a single bit."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 40, (300,), generator=gen).tolist() + [130, 0, 450]
    m, e = sum(counts), len(counts)
    w = torch.randn(e, 24, 32, generator=gen)
    a_k, a_n = torch.randn(m, 32, generator=gen), torch.randn(m, 24, generator=gen)
    index = torch.randperm(m, generator=gen)
    offsets, threads = _offsets(counts), torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append((cpu_kernels.rows_times_wt(a_k, w, offsets, index, relu=True),
                            cpu_kernels.rows_times_w(a_n, w, offsets),
                            cpu_kernels.rows_outer(a_n, a_k, offsets, b_index_M=index)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for one, same in zip(results[0], other):
            assert torch.equal(one, same)
    torch.testing.assert_close(results[0][2], torch.stack(_per_expert(counts, lambda i, r: a_n[r].t() @ a_k[index][r])),
                               rtol=1e-4, atol=1e-4)   # sums of up to 450 float32 products


def test_non_contiguous_operands_are_taken_as_their_values():
    gen = torch.Generator().manual_seed(1)
    counts = [3, 0, 2]
    a = torch.randn(20, 5, generator=gen).t()                # [5, 20], not contiguous
    w = torch.randn(3, 20, 7, generator=gen).transpose(1, 2)  # [3, 7, 20], not contiguous
    torch.testing.assert_close(cpu_kernels.rows_times_wt(a, w, _offsets(counts)),
                               torch.cat(_per_expert(counts, lambda i, rows: a[rows] @ w[i].t())))


def _probe(env_update: dict, tmp_path) -> subprocess.CompletedProcess:
    """A fresh process (the library is loaded once per process): is it available, and what was warned."""
    code = ("import warnings, torch\n"
            "from moe_scale.moe.cpu_backend import kernels as cpu_kernels\n"
            "from moe_scale.moe.experts import expert_ffn\n"
            "from moe_scale.moe.experts.grouped_gemm import GroupLayout\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    ok = cpu_kernels.available(torch.empty(0))\n"
            "    layout = GroupLayout([2, 1], torch.empty(0))\n"
            "    y = expert_ffn(torch.randn(3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 4), [2, 1])\n"
            "print(ok, layout.kernel, tuple(y.shape))\n"
            "for w in caught: print('WARNING', w.message)\n")
    env = {**os.environ, "MOE_SCALE_CACHE": str(tmp_path / "cache"), **env_update}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


# Size: fresh processes and a real compiler run into an empty cache directory, the point; nothing to shrink.
@pytest.mark.slow
def test_build_lands_whole_in_the_cache_dir_and_is_reused(tmp_path):
    first = _probe({}, tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == ["True native (3, 4)"]
    built = sorted(p.name for p in (tmp_path / "cache" / "kernels").iterdir())
    assert len(built) == 1 and built[0].startswith("cpu_kernels-") and built[0].endswith(".so")   # no partial file
    library = tmp_path / "cache" / "kernels" / built[0]
    stamp = library.stat().st_mtime_ns
    again = _probe({}, tmp_path)
    assert again.stdout == first.stdout and library.stat().st_mtime_ns == stamp
    library.write_bytes(b"not a shared library")                 # e.g. a copy cut short on a shared home
    broken = _probe({}, tmp_path).stdout.splitlines()
    assert broken[0] == "False grouped (3, 4)"
    assert len(broken) == 2 and "cannot load" in broken[1] and "delete it to rebuild" in broken[1]


@pytest.mark.slow
@pytest.mark.parametrize("env, why", [({"CC": "no-such-compiler"}, "no C compiler 'no-such-compiler' on PATH"),
                                      ({"CC": "false"}, "false failed"),
                                      ({"MOE_SCALE_NATIVE_KERNELS": "0"}, None)],
                         ids=["no_compiler", "compiler_fails", "turned_off"])
def test_without_a_working_compiler_experts_run_on_torch_gemms_after_one_warning(env, why, tmp_path):
    result = _probe(env, tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "False grouped (3, 4)"
    warnings = lines[1:]
    if why is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and why in warnings[0] and "the experts and the noisy gate run on torch's ops" \
            in warnings[0]
    kernels = tmp_path / "cache" / "kernels"
    assert not kernels.exists() or not any(kernels.iterdir())   # nothing half-written


def test_every_kernel_source_ships_in_the_package():
    """Installed from a wheel, the sources come only through package-data: a missing one would fail the
    build on first use, and every run would fall back to torch's ops."""
    import fnmatch
    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["moe_scale.moe.cpu_backend"]
    for source in cpu_kernels._SOURCES:
        assert any(fnmatch.fnmatch(source.name, pattern) for pattern in patterns), source.name
