"""An LSTM counted as cuDNN launches it, whatever path torch takes on this CPU.

On CUDA, `torch._VF.lstm` is one `_cudnn_rnn` forward and one `_cudnn_rnn_backward`. On CPU, torch takes oneDNN's
one operation per layer where oneDNN supports the case (float32; bfloat16 only on CPUs with AVX-512), and otherwise
its per-timestep decomposition (gates, sigmoid, tanh, a matmul per step: about 14 operations a timestep each way).
A step counter that saw the CPU's path would count a different number on every CPU; `one_kernel_lstm` makes it count
the GPU's, so the count does not depend on the machine that measured it.

    with one_kernel_lstm(counter):   # counter: an OpCounter in use
        ...   # every nn.LSTM forward counts one kernel, its backward one more
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from op_count import OpCounter


class _OneKernelLSTM(torch.autograd.Function):
    """torch._VF.lstm(input, hx, params, *options) run by torch's own CPU path with the counter paused, counted as
    one kernel each way. Its gradients are torch's own (autograd.grad through the uncounted graph)."""

    @staticmethod
    def forward(ctx, counter: OpCounter, lstm, n_hx: int, options: tuple, *tensors: torch.Tensor):
        with counter.uncounted(), torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
            outputs = lstm(leaves[0], leaves[1:1 + n_hx], leaves[1 + n_hx:], *options)
        counter.count_kernel("_cudnn_rnn")
        ctx.counter, ctx.leaves, ctx.outputs = counter, leaves, outputs
        return tuple(out.detach() for out in outputs)

    @staticmethod
    def backward(ctx, *grads_out: torch.Tensor):
        wanted = [i for i, leaf in enumerate(ctx.leaves) if leaf.requires_grad]
        pairs = [(out, grad) for out, grad in zip(ctx.outputs, grads_out) if out.requires_grad and grad is not None]
        with ctx.counter.uncounted():
            grads = torch.autograd.grad([out for out, _ in pairs], [ctx.leaves[i] for i in wanted],
                                        [grad for _, grad in pairs], allow_unused=True)
        ctx.counter.count_kernel("_cudnn_rnn_backward")
        grads_in: list[torch.Tensor | None] = [None] * len(ctx.leaves)
        for i, grad in zip(wanted, grads):
            grads_in[i] = grad
        ctx.leaves = ctx.outputs = None
        return (None, None, None, None, *grads_in)


@contextlib.contextmanager
def one_kernel_lstm(counter: OpCounter):
    """Within this block every unpacked `nn.LSTM` (torch._VF.lstm with a padded input) counts as cuDNN's kernels."""
    original = torch._VF.lstm

    def lstm(input, hx, *rest):
        if isinstance(hx, torch.Tensor):   # the packed-sequence overload (input, batch_sizes, hx, ...): not used here
            return original(input, hx, *rest)
        params, options = rest[0], tuple(rest[1:])
        return _OneKernelLSTM.apply(counter, original, len(hx), options, input, *hx, *params)

    with mock.patch.object(torch._VF, "lstm", lstm):
        yield
