"""Memory-lean autograd for the noisy gate's [tokens, experts] arithmetic (Shazeer et al. eq. 4-5, 8-9).

Legend: N tokens, E experts, K top-k, M = K + 1 values kept (the load estimator needs the (K+1)-th).

With thousands of experts every [N, E] tensor is as large as the experts' whole working set (N=2048,
E=4096: 32 MiB each). Plain autograd through softplus, the noise, top-k and the smooth load keeps about
eight of them for the backward and creates as many again there. `noisy_top_k` is the same arithmetic as
one function: it keeps the clean logits, the noise and the noise std, and recomputes the rest in the
backward (in row chunks on CPU, where a chunk stays in cache; as whole tensors on a GPU, so the kernels
launched do not grow with the tokens), whose [N, E] outputs are only the two gradients autograd needs (for x @ W_g and
x @ W_noise). Tests compare it with the plain-autograd reference (`routers.prob_in_top_k`) in value and
gradient. On CPU in float32 the same arithmetic runs as one pass over each row per direction in C
(cpu_gating.c, through moe/cpu_kernels.py) when the native kernels are built.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_scale.moe import cpu_kernels
from moe_scale.moe.kernel_policy import policy_for

_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)


class _NoisyTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, clean_NE: Tensor, z_NE: Tensor, noise_NE: Tensor, eps: float, k: int, smooth_load: bool):
        ctx.eps, ctx.k, ctx.smooth_load = eps, k, smooth_load
        ctx.native = all(cpu_kernels.available(t) for t in (clean_NE, z_NE, noise_NE))
        run = cpu_kernels.noisy_top_k_forward if ctx.native else _forward
        std_NE, top_values_NM, top_idx_NM, load_E = run(clean_NE, z_NE, noise_NE, eps, k, smooth_load)
        ctx.save_for_backward(clean_NE, noise_NE, std_NE, top_values_NM, top_idx_NM)
        ctx.mark_non_differentiable(top_idx_NM)
        return top_values_NM, top_idx_NM, load_E

    @staticmethod
    def backward(ctx, grad_top_NM: Tensor, _grad_idx, grad_load_E: Tensor):
        saved = ctx.saved_tensors   # clean, noise, std, top values, top indices
        grad_top_NM = torch.zeros_like(saved[3]) if grad_top_NM is None else grad_top_NM
        run = cpu_kernels.noisy_top_k_backward if ctx.native else _backward
        grad_clean_NE, grad_z_NE = run(*saved, grad_top_NM, grad_load_E if ctx.smooth_load else None, ctx.eps, ctx.k)
        return grad_clean_NE, grad_z_NE, None, None, None, None


def _forward(clean_NE: Tensor, z_NE: Tensor, noise_NE: Tensor, eps: float, k: int, smooth_load: bool):
    m = min(k + 1, clean_NE.shape[1])
    std_NE = torch.nn.functional.softplus(z_NE).add_(eps)
    noisy_NE = torch.addcmul(clean_NE, noise_NE, std_NE)
    top_values_NM, top_idx_NM = noisy_NE.topk(m, dim=1)
    load_E = clean_NE.new_zeros(clean_NE.shape[1])
    if smooth_load:
        del noisy_NE
        for rows in _chunks(clean_NE):
            z, _ = _standardised(clean_NE[rows], noise_NE[rows], std_NE[rows], top_values_NM[rows], k)
            load_E += z.erf_().add_(1.0).sum(0).mul_(0.5)
    return std_NE, top_values_NM, top_idx_NM, load_E


def _backward(clean_NE: Tensor, noise_NE: Tensor, std_NE: Tensor, top_values_NM: Tensor, top_idx_NM: Tensor,
              grad_top_NM: Tensor, grad_load_E: Tensor | None, eps: float, k: int) -> tuple[Tensor, Tensor]:
    grad_clean = torch.empty_like(clean_NE)
    grad_z = torch.empty_like(clean_NE)
    grad_top_NM = grad_top_NM.clone()   # the thresholds' share is added to it
    for rows in _chunks(clean_NE):
        noise, std = noise_NE[rows], std_NE[rows]
        grad_std = torch.zeros_like(std)
        if grad_load_E is not None:
            z, is_in = _standardised(clean_NE[rows], noise, std, top_values_NM[rows], k)
            # Phi(z)' = exp(-z^2) / sqrt(pi) w.r.t. z * sqrt(2); z = (clean - threshold) / (sqrt(2) std)
            d_clean = _gaussian(z).mul_(_INV_SQRT_PI).div_(_denominator(std)).mul_(grad_load_E)
            grad_std = (d_clean * z).mul_(-math.sqrt(2.0))            # d z / d std = -z sqrt(2) / denom
            grad_top_NM[rows, k] -= (d_clean * is_in).sum(1)          # the thresholds are noisy top values
            grad_top_NM[rows, k - 1] -= (d_clean * ~is_in).sum(1)
        else:
            d_clean = torch.zeros_like(std)
        grad_noisy = torch.zeros_like(std).scatter_(1, top_idx_NM[rows], grad_top_NM[rows])
        grad_clean[rows] = d_clean.add_(grad_noisy)
        # noisy = clean + noise * std; std = softplus(z) + eps and softplus'(z) = 1 - exp(-softplus(z)).
        grad_std.addcmul_(grad_noisy, noise)
        grad_z[rows] = grad_std.mul_(torch.expm1(-(std - eps)).neg_())
    return grad_clean, grad_z


def noisy_top_k(clean_NE: Tensor, z_NE: Tensor, noise_NE: Tensor, eps: float, k: int,
                smooth_load: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Top M = min(K+1, E) of the noisy logits clean + noise * (softplus(z) + eps), as (values, indices), and
    the smooth load_E = sum over tokens of routers.prob_in_top_k (zeros unless `smooth_load`; needs K < E)."""
    return _NoisyTopK.apply(clean_NE, z_NE, noise_NE, eps, k, smooth_load)


# exp(-z^2) below exp(-50) ~ 2e-22 is taken as 0, here and in cpu_gating.c: 2e-22 of the entries near the
# threshold, beyond float32's precision next to them, and it keeps denormals out of the gradient. The
# router's matmul backward multiplies that gradient next, and MKL runs 80x slower on denormal inputs.
_GAUSSIAN_CUTOFF = 50.0


def _gaussian(z: Tensor) -> Tensor:
    q = z * z
    return torch.exp(q.clamp(max=_GAUSSIAN_CUTOFF).neg_()).masked_fill_(q >= _GAUSSIAN_CUTOFF, 0.0)


def _denominator(std: Tensor) -> Tensor:
    return std * math.sqrt(2.0) + 1e-20


def _standardised(clean, noise, std, top_values_NM, k) -> tuple[Tensor, Tensor]:
    """((clean - threshold) / (sqrt(2) std), is_in): the threshold is the noisy (K+1)-th value for an expert
    in the noisy top k, the K-th for one outside it (routers.prob_in_top_k explains why)."""
    thr_in, thr_out = top_values_NM[:, k:k + 1], top_values_NM[:, k - 1:k]
    is_in = torch.addcmul(clean, noise, std) > thr_in      # bitwise the forward's noisy logits
    return (clean - torch.where(is_in, thr_in, thr_out)).div_(_denominator(std)), is_in


def _chunks(like_NE: Tensor):
    n, rows = like_NE.shape[0], policy_for(like_NE).gate_chunk_rows or max(like_NE.shape[0], 1)
    return (slice(start, start + rows) for start in range(0, n, rows))
