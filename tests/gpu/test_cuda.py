"""On a CUDA GPU (skipped elsewhere; `pytest -m gpu`, run by tools/gpu_check.sh): the MoE layer in bfloat16 and
float32 against the CPU float32 reference, its kernels and host synchronisations on the real device, short
training runs of an LSTM-MoE and a transformer MoE, and the layer benchmark."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from moe_scale.moe.experts.grouped_gemm import choose_kernel
from moe_scale.moe.router.hierarchical import HierarchicalRouter
from moe_scale.moe.layer import MoELayer
from tests.paths import REPO
from tests.moe.layers import hierarchical_layer, moe_layer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D, H, E, K, N = 64, 128, 32, 2, 512
# Seconds for each training run and benchmark these tests start (tools/gpu_check.sh sets it short: a lease's
# minutes are few, and a stage's limit should stop a hang, not the 900 s a run on one's own GPU may take).
SUBPROCESS_TIMEOUT = float(os.environ.get("MOE_SCALE_GPU_TEST_TIMEOUT", "900"))


def _layer(gate: str) -> MoELayer:
    if gate == "hierarchical":
        layer = hierarchical_layer(D, H, E, K, seed=3, router=HierarchicalRouter(D, 8, E // 8, 2, 2))
    elif gate == "swiglu":   # the llama block's experts (moe/experts/kinds.py) behind the flat gate
        layer = moe_layer(D, H, E, K, seed=3, activation="swiglu")
    else:
        layer = moe_layer(D, H, E, K, seed=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():   # a spread gate (the zero init routes by noise alone)
        for name, p in layer.router.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "noise" in name else 1.0) / math.sqrt(D))
    return layer.train()


class _FixedNoise:
    """The same standard-normal noise on every device: drawn once on CPU for each shape asked."""

    def __init__(self):
        self.cache = {}

    def __call__(self, n, e, device):
        if (n, e) not in self.cache:
            self.cache[(n, e)] = torch.randn(n, e, generator=torch.Generator().manual_seed(n * 131 + e))
        return self.cache[(n, e)].to(device)


def _tf32_grid(t: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to TF32's 10 mantissa bits, which TF32 products then read exactly."""
    bits = t.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def _run(layer: MoELayer, x: torch.Tensor, upstream: torch.Tensor):
    layer.router.noise_sampler = _FixedNoise()
    experts_NK = layer.router(x).experts_NK.cpu()
    layer.router.noise_sampler = _FixedNoise()
    x = x.clone().requires_grad_(True)
    y, aux = layer(x)
    torch.autograd.backward([y, aux], [upstream, torch.ones_like(aux)])
    grads = {name: p.grad.float().cpu() for name, p in layer.named_parameters()}
    return y.float().detach().cpu(), aux.float().detach().cpu(), x.grad.float().cpu(), grads, experts_NK


@pytest.mark.parametrize("gate", ["flat", "hierarchical", "swiglu"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-3), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
def test_layer_on_cuda_matches_the_cpu_float32_reference(gate, dtype, tol):
    gen = torch.Generator().manual_seed(11)
    x, upstream = torch.randn(N, D, generator=gen), torch.randn(N, D, generator=gen)
    # Both sides see the same inputs and weights, rounded to what the GPU's products read: bfloat16, or for
    # float32 the TF32 grid of Triton's tl.dot. (Unrounded, a ReLU input whose sign the rounding flips flips a
    # gradient entry: 1-2% relative error in x.grad and w_in, measured on CPU with emulated TF32.)
    grid = (lambda t: t.bfloat16().float()) if dtype == torch.bfloat16 else _tf32_grid
    x, upstream = grid(x), grid(upstream)
    reference_layer = _layer(gate)
    reference_layer.load_state_dict({k: grid(v) for k, v in reference_layer.state_dict().items()})
    gpu_layer = _layer(gate)
    gpu_layer.load_state_dict(reference_layer.state_dict())
    gpu_layer = gpu_layer.to("cuda", dtype)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False   # the float32 comparison is against exact float32 products
    try:
        want = _run(reference_layer, x, upstream)
        got = _run(gpu_layer, x.to("cuda", dtype), upstream.to("cuda", dtype))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    for name, a, b in [("y", got[0], want[0]), ("aux", got[1], want[1]), ("x.grad", got[2], want[2]),
                       *[(n, got[3][n], want[3][n]) for n in want[3]]]:
        error = (a - b).norm() / b.norm().clamp_min(1e-12)
        assert error < tol, f"{gate} {dtype} {name}: relative error {error:.2e}"
    # routing: the same experts (the router computes in float32 from the same values on both devices; only
    # near-ties may differ, through the order of a matrix product's sums)
    same = (got[4] == want[4]).float().mean()
    assert same == 1.0 if dtype == torch.float32 else same > 0.99, same


def test_kernels_chosen_on_this_gpu():
    major = torch.cuda.get_device_capability()[0]
    bf16 = torch.empty(0, device="cuda", dtype=torch.bfloat16)
    assert choose_kernel(bf16) == ("grouped" if major in (9, 10) else "triton")
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("float32 takes the Triton kernel, and triton is not installed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a per-expert loop would warn
        assert choose_kernel(torch.empty(0, device="cuda")) == "triton"


@pytest.mark.parametrize("experts", [64, 2048])
def test_one_host_read_forward_and_none_backward_on_the_device(experts):
    """CUDA's own sync detector: the forward synchronises once (the counts for the all-to-all), the backward
    never; 2,048 local experts take two grouped-GEMM calls and still no more."""
    layer = moe_layer(D, H, experts, K, seed=1).to("cuda", torch.bfloat16).train()
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y, aux = layer(x)   # warm-up: lazy initialisation may synchronise
    torch.autograd.backward([y, aux], [torch.ones_like(y), torch.ones_like(aux)])
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            y, aux = layer(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.backward([y, aux], [torch.ones_like(y), torch.ones_like(aux)])
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _train(tmp_path: Path, *flags: str) -> list[dict]:
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "moe_scale", "train", "--max-steps", "20", "--log-interval", "5",
                           "--eval-interval", "20", "--eval-max-batches", "2", "--ds-config",
                           str(REPO / "ds_configs" / "gpu_bf16_zero2.json"), "--out", str(run), *flags],
                          cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert math.isfinite(summary["valid_ppl"]) and summary["mfu"] > 0
    steps = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert all(math.isfinite(r["loss"]) for r in steps) and steps[-1]["loss"] < steps[0]["loss"]
    return steps


def test_twenty_steps_of_the_lstm_moe_on_one_gpu(tmp_path):
    _train(tmp_path, "--num-experts", "64", "--d-model", "256", "--expert-hidden", "512", "--batch-size", "64")


def test_twenty_steps_of_a_transformer_moe_on_one_gpu(tmp_path):
    _train(tmp_path, "--model", "transformer", "--ffn", "moe", "--num-experts", "16", "--d-model", "256",
           "--num-layers", "2", "--num-heads", "4", "--expert-hidden", "512", "--seq-len", "128", "--batch-size", "16")


def test_twenty_steps_of_a_mixtral_style_transformer_on_one_gpu(tmp_path):
    _train(tmp_path, "--model", "transformer", "--block", "llama", "--ffn", "moe", "--num-experts", "16",
           "--d-model", "256", "--num-layers", "2", "--num-heads", "4", "--expert-hidden", "512", "--seq-len", "128",
           "--batch-size", "16")


def test_layer_benchmark_on_cuda(tmp_path):
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "bench_moe_layer.py"), "--device", "cuda", "--dtype",
                           "bfloat16", "--experts", "8,64", "--k", "2", "--tokens", "2048", "--d", "256", "--h", "512",
                           "--impls", "dropless,deepspeed_dropless,dense", "--out", str(out)],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ours = [r for r in rows if r["impl"] == "dropless"]
    assert len(ours) == 2 and all(r["time_s"] > 0 and r["speedup_vs_deepspeed"] > 0 and r["device"] == "cuda"
                                  for r in ours)
