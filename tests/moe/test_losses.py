import pytest
import torch

from op_count import OpCounter
from moe_scale.moe.losses import balance_loss, cv_squared


@pytest.mark.parametrize("n", [2, 4, 7, 256])
def test_one_hot_gives_n_minus_1(n):
    v = torch.zeros(n)
    v[n // 2] = 5.0  # scale must not matter
    assert cv_squared(v).item() == pytest.approx(n - 1, rel=1e-6)


def test_one_hot_length_4_is_3():
    assert cv_squared(torch.tensor([0.0, 1.0, 0.0, 0.0])).item() == pytest.approx(3.0, rel=1e-6)


def test_constant_vector_is_zero():
    assert cv_squared(torch.full((16,), 3.5)).item() == pytest.approx(0.0, abs=1e-12)
    assert torch.isfinite(cv_squared(torch.zeros(8)))  # the epsilons keep an all-zero vector finite


def test_matches_hand_computation():
    v = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    # mean 3, population variance (4 + 1 + 0 + 9) / 4 = 3.5, cv2 = 3.5 / 9
    assert cv_squared(v).item() == pytest.approx(3.5 / 9, rel=1e-8)


def test_population_not_unbiased_variance():
    v = torch.tensor([0.3, 1.7, 2.2, 0.1, 5.0], dtype=torch.float64)
    n = v.numel()
    unbiased = v.var() / v.mean() ** 2
    assert cv_squared(v).item() == pytest.approx(unbiased.item() * (n - 1) / n, rel=1e-8)


def test_gradient_flows_and_half_precision_is_upcast():
    v = torch.tensor([1.0, 2.0, 4.0], requires_grad=True)
    cv_squared(v).backward()
    assert v.grad.abs().sum() > 0
    out = cv_squared(torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.bfloat16))
    assert out.dtype == torch.float32 and out.item() == pytest.approx(3.0, rel=1e-6)


@pytest.mark.parametrize("weights", [(0.1, 0.1), (0.3, 0.7), (0.0, 0.5), (0.25,)])
def test_balance_loss_is_the_weighted_cv_squared_with_its_gradient(weights):
    """The fused loss against cv_squared of each row through plain autograd: value and gradient, float64."""
    gen = torch.Generator().manual_seed(len(weights))
    stats = (torch.rand(len(weights), 37, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    stats.data[0, 5] = 0.0   # an expert that got nothing
    got = balance_loss(stats, weights)
    want = sum(w * cv_squared(row) for w, row in zip(weights, stats))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=0)
    (grad_got,), (grad_want,) = (torch.autograd.grad(loss * 1.7, stats) for loss in (got, want))
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-9, atol=1e-15)
    torch.autograd.gradcheck(lambda s: balance_loss(s, weights), (stats[:, :6].detach().clone().requires_grad_(),))


def test_balance_loss_upcasts_half_precision_and_refuses_a_weight_count_that_does_not_match():
    stats = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.bfloat16)
    out = balance_loss(stats, (1.0, 1.0))
    assert out.dtype == torch.float32 and out.item() == pytest.approx(3.0, rel=1e-6)
    with pytest.raises(ValueError, match="2 weights for statistics of shape \\(3, 4\\)"):
        balance_loss(torch.ones(3, 4), (0.1, 0.1))


def test_balance_loss_launches_a_fixed_few_kernels():
    """6 forward and 8 backward (autograd's seed aside) for importance and load together, where autograd through
    cv_squared took 12 and 22: structure, checked on CPU."""
    stats = torch.rand(2, 64, requires_grad=True)
    with OpCounter() as forward:
        loss = balance_loss(stats, (0.1, 0.2))
    with OpCounter() as backward:
        loss.backward()
    assert forward.kernel_ops == 6 and backward.kernel_ops - backward.by_name["ones_like"] <= 9, backward.by_name
