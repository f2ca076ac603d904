import pytest
import torch

from moe_scale.moe.losses import cv_squared


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
