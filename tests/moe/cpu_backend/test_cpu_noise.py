"""cpu_noise.c: Philox4x32-10 against Random123's known answers; the normal noise's distribution (moments,
Kolmogorov-Smirnov distance, tails, correlations); reproducibility under torch.manual_seed, any thread count
and any length; and the router drawing its noise from it on CPU."""

import ctypes
import math

import pytest
import torch

from moe_scale.moe.cpu_backend import kernels as cpu_kernels
from moe_scale.moe.router import sample_noise

pytestmark = pytest.mark.skipif(not cpu_kernels.available(torch.empty(0)),
                                reason="native kernels not built (see the warning); torch.randn is used")


def _philox(counter, key):
    out = (ctypes.c_uint32 * 4)()
    cpu_kernels._library().philox4x32_10_block((ctypes.c_uint32 * 4)(*counter), (ctypes.c_uint32 * 2)(*key), out)
    return list(out)


def test_philox_matches_random123_known_answers():
    """Random123's kat_vectors for philox4x32 with 10 rounds."""
    assert _philox([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert _philox([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert _philox([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0]) == \
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@pytest.fixture(scope="module")
def sample():
    torch.manual_seed(0)
    return cpu_kernels.standard_normal(1024, 4096).double()   # 2^22 values


def test_moments_and_tails_are_a_standard_normals(sample):
    x = sample.flatten()
    n = x.numel()
    assert abs(x.mean().item()) < 5 / math.sqrt(n)
    assert abs(x.var().item() - 1) < 5 * math.sqrt(2 / n)
    assert abs((x ** 3).mean().item()) < 5 * math.sqrt(15 / n)              # skewness 0
    assert abs((x ** 4).mean().item() - 3) < 5 * math.sqrt(96 / n)          # kurtosis 3
    beyond_3 = (x.abs() > 3).double().mean().item()                          # 2.70e-3
    assert abs(beyond_3 - 0.0026998) < 5 * math.sqrt(0.0027 / n)
    assert x.abs().max().item() <= math.sqrt(2 * 24 * math.log(2)) + 1e-5   # 24-bit uniforms: |x| <= 5.77


def test_kolmogorov_smirnov_distance_to_the_normal_cdf(sample):
    x, _ = sample.flatten().sort()
    n = x.numel()
    cdf = torch.special.ndtr(x)
    steps = torch.arange(1, n + 1, dtype=torch.float64) / n
    distance = torch.maximum(steps - cdf, cdf - (steps - 1 / n)).max().item()
    assert distance < 1.95 / math.sqrt(n)   # the 0.1% critical value


@pytest.mark.parametrize("lag", [1, 2, 3, 4, 4096])   # within a Box-Muller pair, across pairs and counters, rows
def test_values_are_uncorrelated(sample, lag):
    x = sample.flatten()
    a, b = x[:-lag], x[lag:]
    bound = 5 / math.sqrt(a.numel())
    assert abs((a * b).mean().item()) < bound
    assert abs(((a * a - 1) * (b * b - 1)).mean().item() / 2) < bound       # nor are their magnitudes


def test_reproducible_under_manual_seed_and_independent_of_threads_and_length():
    torch.manual_seed(7)
    first = cpu_kernels.standard_normal(33, 130)
    torch.manual_seed(7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_kernels.standard_normal(33, 130)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first, single)
    assert not torch.equal(first, cpu_kernels.standard_normal(33, 130))     # the next draw differs
    torch.manual_seed(7)
    longer = cpu_kernels.standard_normal(33 * 130 + 3)   # value i depends on (seed, i) only
    assert torch.equal(longer[:33 * 130], first.flatten())
    for n in (0, 1, 5):
        assert cpu_kernels.standard_normal(n).shape == (n,)


def test_the_router_draws_its_cpu_noise_here_and_elsewhere_from_torch(monkeypatch):
    torch.manual_seed(3)
    noise = sample_noise(None, 16, 40, torch.device("cpu"))
    torch.manual_seed(3)
    assert torch.equal(noise, cpu_kernels.standard_normal(16, 40))
    monkeypatch.setattr(cpu_kernels, "available", lambda like: False)   # no library: torch.randn, as before
    torch.manual_seed(3)
    fallback = sample_noise(None, 16, 40, torch.device("cpu"))
    torch.manual_seed(3)
    assert torch.equal(fallback, torch.randn(16, 40))
