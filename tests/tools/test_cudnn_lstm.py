"""An LSTM counted as cuDNN launches it (tools/cudnn_lstm.py): the same numbers as torch's own path,
one kernel each way whatever path this CPU takes (oneDNN's, or the per-timestep decomposition for bfloat16 without
AVX-512 and for projections)."""

from __future__ import annotations

import pytest
import torch

from cudnn_lstm import one_kernel_lstm
from op_count import OpCounter


def _run(lstm: torch.nn.LSTM, x_BTD: torch.Tensor, state=None):
    out_BTD, (h, c) = lstm(x_BTD, state)
    loss = (out_BTD * torch.linspace(-1, 1, out_BTD.shape[-1], dtype=out_BTD.dtype)).sum() + h.sum() - 2 * c.sum()
    loss.backward()
    return out_BTD.detach(), h.detach(), c.detach()


@pytest.mark.parametrize("proj", [0, 6], ids=["plain", "projected"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "given-state"])
def test_same_outputs_and_gradients_as_torchs_own_path(proj, with_state):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(6, 10, batch_first=True, proj_size=proj, num_layers=2).double()
    x_BTD = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    state = None
    if with_state:
        state = (torch.randn(2, 3, proj or 10, dtype=torch.float64, requires_grad=True),
                 torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True))
    expected = _run(lstm, x_BTD, state)
    grads = [p.grad.clone() for p in (x_BTD, *lstm.parameters(), *(state or ()))]
    for p in (x_BTD, *lstm.parameters(), *(state or ())):
        p.grad = None
    with OpCounter() as counter, one_kernel_lstm(counter):
        got = _run(lstm, x_BTD, state)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for p, g in zip((x_BTD, *lstm.parameters(), *(state or ())), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-12)
    assert counter.by_name["_cudnn_rnn"] == 1 and counter.by_name["_cudnn_rnn_backward"] == 1


def test_one_kernel_each_way_whatever_this_cpus_path():
    """float32 takes oneDNN's path here, bfloat16 (without AVX-512) and projections the decomposition: counted,
    all launch the same kernels."""
    counts = set()
    for dtype in (torch.float32, torch.bfloat16):
        for proj in (0, 8):
            lstm = torch.nn.LSTM(8, 16, batch_first=True, proj_size=proj).to(dtype)
            x_BTD = torch.randn(2, 7, 8, dtype=dtype, requires_grad=True)
            with OpCounter() as counter, one_kernel_lstm(counter):
                lstm(x_BTD)[0].sum().backward()
            assert counter.by_name["_cudnn_rnn"] == 1 and counter.by_name["_cudnn_rnn_backward"] == 1
            assert not {"sigmoid_", "tanh_", "mkldnn_rnn_layer"} & set(counter.by_name)
            counts.add(counter.kernel_ops)
    assert len(counts) == 1, counts


def test_outside_the_block_torch_runs_unchanged():
    original = torch._VF.lstm
    with OpCounter() as counter, one_kernel_lstm(counter):
        assert torch._VF.lstm is not original
    assert torch._VF.lstm is original
