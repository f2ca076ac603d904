"""The Triton grouped-GEMM path (what A100s and float32/float16 GPU runs take) on CPU, in Triton's interpreter.

Run by tests/moe/test_triton_kernel.py in a child process with TRITON_INTERPRET=1 (it must be set before
Triton's kernels are defined). Two things stand in for a GPU: DeepSpeed defines its kernels only where a
Triton driver is active, so the CUDA driver is reported active (the interpreter needs none); and autotuning
times its candidate configurations on a GPU, so each kernel keeps one of them (TRITON_CONFIG picks which).
Exits non-zero, with torch's assertion message, on the first mismatch.

Checked against torch's F.grouped_mm on the same tensors: the two products (forward rows, weight gradients)
with empty experts and calls split at a few experts, a weight's transpose, float16 (bfloat16 takes the same
code, but the interpreter's tl.dot mis-multiplies bfloat16: off by 1e10 in Triton 3.9); and the MoE layer's
forward and every gradient, flat and hierarchical gates, with the kernel the layer chooses on such a GPU.
"""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import triton  # noqa: E402
from triton.backends import backends  # noqa: E402

backends["nvidia"].driver.is_active = staticmethod(lambda: True)
_autotune, _config = triton.autotune, int(os.environ.get("TRITON_CONFIG", "0"))
triton.autotune = lambda configs, **kw: _autotune(configs=configs[_config:_config + 1], **kw)

import torch  # noqa: E402

from moe_scale.deepspeed_internals import triton_grouped_gemm  # noqa: E402
from moe_scale.moe.experts import grouped_gemm  # noqa: E402
from moe_scale.moe.experts.grouped_gemm import GroupLayout, per_expert_outer, rows_times_expert  # noqa: E402
from moe_scale.moe.kernel_policy import KernelPolicy, forced_policy, gpu_decisions  # noqa: E402
from tests.moe.layers import hierarchical_layer, moe_layer  # noqa: E402

COUNTS = ([3, 1, 5, 2], [0, 40, 0, 0, 7, 0], [0, 0, 70, 0], [6], [0, 0, 0])


def check_products() -> None:
    for dtype, tol in ((torch.float32, {}), (torch.float16, {"rtol": 2e-3, "atol": 2e-2})):
        for counts in COUNTS:
            gen = torch.Generator().manual_seed(sum(counts) + len(counts))
            m, e = sum(counts), len(counts)
            a = torch.randn(m, 24, generator=gen).to(dtype)
            b = torch.randn(e, 24, 136, generator=gen).to(dtype)          # 136: two tiles of output columns
            b_t = torch.randn(e, 136, 24, generator=gen).to(dtype).transpose(1, 2)   # a weight's transpose
            g = torch.randn(m, 136, generator=gen).to(dtype)
            for max_groups in (None, 1, 3):
                with forced_policy(KernelPolicy(native_cpu=False, gate_chunk_rows=None, max_groups=max_groups)):
                    triton_layout = GroupLayout(torch.tensor(counts), a, "triton")
                    grouped_layout = GroupLayout(torch.tensor(counts), a, "grouped")
                    assert (triton_layout.chunks is None) == (max_groups is None or e <= max_groups)
                    for bb in (b, b_t):
                        torch.testing.assert_close(rows_times_expert(a, bb, triton_layout),
                                                   rows_times_expert(a, bb, grouped_layout), **tol)
                    outer = per_expert_outer(a, g, triton_layout)
                    torch.testing.assert_close(outer, per_expert_outer(a, g, grouped_layout), **tol)
                    for expert, count in enumerate(counts):   # experts without rows: exact zeros
                        assert count or torch.count_nonzero(outer[expert]) == 0


def layer_run(make_layer, kernel: str, x: torch.Tensor, probe: torch.Tensor):
    """The layer's output and every gradient with all grouped products on `kernel`, as a GPU would decide."""
    torch.manual_seed(0)
    layer = make_layer()
    choose = grouped_gemm.choose_kernel
    grouped_gemm.choose_kernel = lambda like: kernel
    try:
        with gpu_decisions():
            y, aux = layer(x)
            ((y * probe).sum() + aux).backward()
    finally:
        grouped_gemm.choose_kernel = choose
    return y.detach(), {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def check_layers() -> None:
    from moe_scale.moe.router.hierarchical import HierarchicalRouter

    def flat():
        layer = moe_layer(32, 48, 8, 2, noisy_gating=False)
        torch.nn.init.normal_(layer.router.w_gate, std=0.5)
        return layer

    def hierarchical():
        router = HierarchicalRouter(32, 4, 3, k_primary=2, k_secondary=2)
        for p in router.parameters():
            torch.nn.init.normal_(p, std=0.5)
        return hierarchical_layer(32, 48, 12, 4, router=router).eval()   # eval: no noise, the same routing twice

    gen = torch.Generator().manual_seed(1)
    x, probe = torch.randn(96, 32, generator=gen), torch.randn(96, 32, generator=gen)
    ops, calls = triton_grouped_gemm(), []

    def counted(name):   # the Triton kernels' calls are counted: the layers must take them
        kernel = getattr(ops, name)

        def call(*args):
            calls.append(name)
            return kernel(*args)
        return call

    for name in ("_group_gemm", "_grouped_dw"):
        setattr(ops, name, counted(name))
    for make in (flat, hierarchical):
        calls.clear()
        (y_t, grads_t), (y_g, grads_g) = (layer_run(make, k, x, probe) for k in ("triton", "grouped"))
        assert calls.count("_group_gemm") >= 3 and calls.count("_grouped_dw") >= 2, (make.__name__, calls)
        torch.testing.assert_close(y_t, y_g, rtol=1e-5, atol=1e-5)
        assert grads_t.keys() == grads_g.keys() and grads_t
        for name in grads_t:
            torch.testing.assert_close(grads_t[name], grads_g[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"{make.__name__} {name}: {m}")


if __name__ == "__main__":
    ops = triton_grouped_gemm()
    assert ops is not None, "triton_grouped_gemm() found no Triton grouped GEMM"
    check_products()
    check_layers()
    print("triton kernel: products and layers match F.grouped_mm", file=sys.stderr)
