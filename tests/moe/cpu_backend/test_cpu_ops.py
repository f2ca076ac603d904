"""The native CPU kernels as torch.library custom ops (moe_scale::*): torch.library.opcheck on each (schema,
fake implementation, dispatch), and torch.compile tracing through them: a compiled expert FFN and noisy top-k,
forward and backward, keeps the ops in its graph (no graph break at a ctypes call) and equals eager."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from moe_scale.moe.cpu_backend import kernels as cpu_kernels
from moe_scale.moe.experts import expert_ffn
from moe_scale.moe.router.gating_ops import noisy_top_k

pytestmark = pytest.mark.skipif(not cpu_kernels.available(torch.empty(0)),
                                reason="native kernels not built (no C compiler?)")

COUNTS = [3, 0, 5, 2]


def _expert_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    m, d, f = sum(COUNTS), 8, 12
    offsets = torch.tensor([0, *COUNTS]).cumsum(0)
    return (torch.randn(m, d, generator=g), torch.randn(len(COUNTS), f, d, generator=g),
            torch.randn(len(COUNTS), f, d, generator=g), offsets, torch.randperm(m, generator=g))


def test_every_kernel_is_a_registered_op_that_passes_opcheck():
    x, w_in, w_out, offsets, perm = _expert_inputs()
    hidden = torch.relu(torch.randn(x.shape[0], w_in.shape[1]))
    n, e, k = 10, 6, 2
    clean, z, noise = torch.randn(n, e), torch.randn(n, e), torch.randn(n, e)
    softplus, top_values, top_idx, _ = cpu_kernels.noisy_top_k_forward(clean, z, noise, 1e-2, k, True)
    ops = torch.ops.moe_scale
    cases = [
        (ops.rows_times_wt, (x, w_in, offsets, None, True)),
        (ops.rows_times_wt, (x, w_in, offsets, perm, False)),
        (ops.rows_times_wt_relu_grad, (torch.randn_like(x), w_out, offsets, perm, hidden, torch.rand(x.shape[0]))),
        (ops.rows_times_w, (hidden, w_out, offsets)),
        (ops.rows_outer_, (x, hidden, offsets, torch.empty(len(COUNTS), x.shape[1], hidden.shape[1]), False, perm)),
        (ops.noisy_top_k_forward, (clean, z, noise, 1e-2, k, True)),
        (ops.noisy_top_k_backward, (clean, noise, softplus, top_values, top_idx, torch.randn_like(top_values),
                                    torch.randn(e), 1e-2, k)),
        (ops.standard_normal, (torch.tensor(1234), [3, 5])),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                    "test_aot_dispatch_dynamic"))


class _OpsSeen:
    """A torch.compile backend that records the ops in each graph it is given, then runs it eagerly."""

    def __init__(self):
        self.targets: list[str] = []
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def record(graph, _inputs):
            for node in graph.graph.nodes:
                if node.op == "call_function":   # an op that writes its input is wrapped: name the op inside
                    functionalized = "auto_functionalized" in str(node.target)
                    self.targets.append(str(node.args[0] if functionalized else node.target))
            return make_boxed_func(graph.forward)
        self.graphs += 1
        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)


def test_compiled_expert_ffn_and_gate_trace_through_the_ops_and_equal_eager():
    x, w_in, w_out, _, perm = _expert_inputs()
    n, e, k = 12, 6, 2
    g = torch.Generator().manual_seed(1)
    clean, z, noise = torch.randn(n, e, generator=g), torch.randn(n, e, generator=g), torch.randn(n, e, generator=g)

    def step(x, w_in, w_out, clean, z):
        y = expert_ffn(x, w_in, w_out, COUNTS, perm, None, 0.5)
        top_values, top_idx, load = noisy_top_k(clean, z, noise, 1e-2, k, True)
        return y.square().sum() + top_values.sum() + load.square().sum()

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w_in, w_out, clean, z)]
        loss = fn(*leaves)
        loss.backward()
        return loss.detach(), [t.grad for t in leaves]

    backend = _OpsSeen()
    torch._dynamo.reset()
    eager_loss, eager_grads = grads(step)
    compiled_loss, compiled_grads = grads(torch.compile(step, backend=backend))
    torch.testing.assert_close(compiled_loss, eager_loss)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)
    assert backend.graphs == 1   # no graph break
    seen = " ".join(backend.targets)
    for name in ("rows_times_wt", "rows_times_wt_relu_grad", "rows_outer_", "noisy_top_k_forward",
                 "noisy_top_k_backward"):
        assert f"moe_scale.{name}" in seen, (name, sorted(set(backend.targets)))
