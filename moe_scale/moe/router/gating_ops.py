"""Memory-lean autograd for the noisy gate's [tokens, experts] arithmetic (Shazeer et al. eq. 4-5, 8-9).

Legend (docs/shapes.md): N tokens, E experts, K experts per token, K1 logits kept per token (min(K+1, E):
the load estimator needs the (K+1)-th).

With thousands of experts every [N, E] tensor is as large as the experts' whole working set (N=2048,
E=4096: 32 MiB each). Plain autograd through softplus, the noise, top-k and the smooth load keeps about
eight of them for the backward and creates as many again there. `noisy_top_k` is the same arithmetic as
one function: it keeps the clean logits, the noise and softplus(z) (the std less eps), and recomputes the rest in
the backward (in row chunks on CPU, where a chunk stays in cache; as whole tensors on a GPU, so the kernels
launched do not grow with the tokens), whose [N, E] outputs are only the two gradients autograd needs (for x @ W_g and
x @ W_noise). Tests compare it with the plain-autograd reference (`routers.prob_in_top_k`) in value and
gradient. On CPU in float32 the same arithmetic runs as one pass over each row per direction in C
(cpu_gating.c, through moe/cpu_backend/kernels.py) when the native kernels are built.

It keeps softplus(z), not the std: the backward needs softplus'(z) = 1 - exp(-softplus(z)), which std - eps
gives only to the float32 spacing next to eps (1e-9 at eps = 1e-2; softplus(-16) = 1e-7: relative errors of
1e-3 at z = -16, 0.1 at -20, 1 from -30 on), while std = softplus(z) + eps comes back from it bitwise (one
rounded add, as in the forward).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_scale.moe.cpu_backend import kernels as cpu_kernels
from moe_scale.moe.kernel_policy import policy_for

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)


class _NoisyTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, clean_NE: Tensor, z_NE: Tensor, noise_NE: Tensor, eps: float, k: int, smooth_load: bool,
                row_group_N: Tensor | None, num_groups: int):
        ctx.eps, ctx.k, ctx.smooth_load = eps, k, smooth_load
        ctx.native = row_group_N is None and all(cpu_kernels.available(t) for t in (clean_NE, z_NE, noise_NE))
        if ctx.native:
            softplus_NE, top_values_NK1, top_idx_NK1, load_E = cpu_kernels.noisy_top_k_forward(
                clean_NE, z_NE, noise_NE, eps, k, smooth_load)
        else:
            softplus_NE, top_values_NK1, top_idx_NK1, load_E = _forward(clean_NE, z_NE, noise_NE, eps, k,
                                                                       smooth_load, row_group_N, num_groups)
        ctx.row_group_N = row_group_N
        ctx.save_for_backward(clean_NE, noise_NE, softplus_NE, top_values_NK1, top_idx_NK1)
        ctx.mark_non_differentiable(top_idx_NK1)
        return top_values_NK1, top_idx_NK1, load_E

    @staticmethod
    def backward(ctx, grad_top_NK1: Tensor, _grad_idx, grad_load_E: Tensor):
        saved = ctx.saved_tensors   # clean, noise, softplus(z), top values, top indices
        grad_top_NK1 = torch.zeros_like(saved[3]) if grad_top_NK1 is None else grad_top_NK1
        grad_load = grad_load_E if ctx.smooth_load else None
        if ctx.native:
            grad_clean_NE, grad_z_NE = cpu_kernels.noisy_top_k_backward(*saved, grad_top_NK1, grad_load, ctx.eps, ctx.k)
        else:
            grad_clean_NE, grad_z_NE = _backward(*saved, grad_top_NK1, grad_load, ctx.eps, ctx.k, ctx.row_group_N)
        return grad_clean_NE, grad_z_NE, None, None, None, None, None, None


def _forward(clean_NE: Tensor, z_NE: Tensor, noise_NE: Tensor, eps: float, k: int, smooth_load: bool,
             row_group_N: Tensor | None = None, num_groups: int = 0):
    m = min(k + 1, clean_NE.shape[1])
    softplus_NE = torch.nn.functional.softplus(z_NE)
    std_NE = softplus_NE + eps
    noisy_NE = torch.addcmul(clean_NE, noise_NE, std_NE)
    top_values_NK1, top_idx_NK1 = noisy_NE.topk(m, dim=1)
    e = clean_NE.shape[1]
    if not smooth_load:
        return (softplus_NE, top_values_NK1, top_idx_NK1,
                clean_NE.new_zeros(e if row_group_N is None else (num_groups, e)))
    load = None
    for clean, noisy, std, top_values, row_group in _blocks(clean_NE, noisy_NE, std_NE, top_values_NK1, row_group_N):
        # P(x, i) = Phi(u) = (1 + erf(u / sqrt 2)) / 2, u = (clean - threshold) / std (eq. 9)
        u = _standardised(clean, noisy, _divisor(std, eps), top_values, k, negated=False)[0]
        p = u.mul_(_INV_SQRT_2).erf_().add_(1.0).mul_(0.5)
        if row_group_N is None:
            part = p.sum(0)
            load = part if load is None else load.add_(part)
        else:
            load = (clean_NE.new_zeros(num_groups, e) if load is None else load).index_add_(0, row_group, p)
    if load is None:   # no rows
        load = clean_NE.new_zeros(e if row_group_N is None else (num_groups, e))
    return softplus_NE, top_values_NK1, top_idx_NK1, load


def _backward(clean_NE: Tensor, noise_NE: Tensor, softplus_NE: Tensor, top_values_NK1: Tensor, top_idx_NK1: Tensor,
              grad_top_NK1: Tensor, grad_load: Tensor | None, eps: float, k: int,
              row_group_N: Tensor | None = None) -> tuple[Tensor, Tensor]:
    parts = [_backward_rows(*block, grad_load, eps, k) for block in _blocks(
        clean_NE, noise_NE, softplus_NE, top_values_NK1, top_idx_NK1, grad_top_NK1, row_group_N)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _backward_rows(clean, noise, softplus, top_values, top_idx, grad_top, row_group, grad_load, eps: float, k: int):
    """(gradient of the clean logits, of the noise logits) for one block of rows.

    With v = (threshold - clean) / std and phi the standard normal density, P = Phi(-v), so d P / d clean =
    phi(v) / std = -d P / d threshold and d P / d std = v phi(v) / std. `down` holds minus the load's gradient
    of the clean logits, and the std's gradient is built negated: each sign folds into an operation already
    there (on a GPU every whole-tensor operation is a kernel launch)."""
    grad_noisy = torch.zeros_like(softplus).scatter_(1, top_idx, grad_top)
    if grad_load is None:
        grad_clean, minus_grad_std = grad_noisy, torch.mul(grad_noisy, noise).neg_()
    else:
        std = softplus + eps
        divisor = _divisor(std, eps)
        v, is_in = _standardised(clean, torch.addcmul(clean, noise, std), divisor, top_values, k, negated=True)
        # each row's share of the load gradient (the [E] vector, or its group's row of [G, E]), times -1/sqrt(2 pi)
        scale = grad_load * -_INV_SQRT_2PI if row_group is None else \
            grad_load.index_select(0, row_group).mul_(-_INV_SQRT_2PI)
        down = _gaussian(v).mul_(scale).div_(divisor)
        # The thresholds are noisy top values: the (K+1)-th for experts in the top K, else the K-th.
        down_in, down_all = (down * is_in).sum(1), down.sum(1)
        grad_noisy.scatter_add_(1, top_idx[:, k - 1:k + 1], torch.stack([down_all - down_in, down_in], 1))
        grad_clean = grad_noisy - down
        minus_grad_std = torch.mul(down, v).addcmul_(grad_noisy, noise, value=-1.0)
    # noisy = clean + noise * std; std = softplus(z) + eps and softplus'(z) = 1 - exp(-softplus(z)).
    return grad_clean, minus_grad_std.mul_(_minus_softplus_derivative(softplus))


def noisy_top_k(clean_NE: Tensor, z_NE: Tensor, noise_NE: Tensor, eps: float, k: int, smooth_load: bool,
                row_group_N: Tensor | None = None, num_groups: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Top K1 = min(K+1, E) of the noisy logits clean + noise * (softplus(z) + eps), as (values, indices), and
    the smooth load_E = sum over tokens of routers.prob_in_top_k (zeros unless `smooth_load`; needs K < E).
    With `row_group_N` (the group of each row, < `num_groups`), the load is summed per group: [G, E] (the
    hierarchical gate's secondary loads, one row per group)."""
    return _NoisyTopK.apply(clean_NE, z_NE, noise_NE, eps, k, smooth_load, row_group_N, num_groups)


# exp(-v^2 / 2) below exp(-50) ~ 2e-22 is taken as 0, here and in cpu_gating.c: 2e-22 of the entries near the
# threshold, beyond float32's precision next to them, and it keeps denormals out of the gradient. The
# router's matmul backward multiplies that gradient next, and MKL runs 80x slower on denormal inputs.
_GAUSSIAN_CUTOFF = 50.0
_GAUSSIAN_FLOOR = math.exp(-_GAUSSIAN_CUTOFF)


# Below z = -60 the C kernel holds softplus(z) at softplus(-60) (cpu_gating.c: libmvec's fast path); softplus' is
# held there too, here as there: 9e-27, never a denormal, where the true value is smaller still.
_SOFTPLUS_FLOOR = math.log1p(math.exp(-60.0))
# Below this eps the std may be 0 (softplus underflows): the standardisation divides by std + 1e-20 (a step, never
# NaN); from it on std >= eps and std + 1e-20 == std.
_EPS_WITHOUT_GUARD = 1e-6


def _minus_softplus_derivative(softplus: Tensor) -> Tensor:
    """-softplus'(z) = -sigmoid(z) = expm1(-softplus(z)), to the precision of softplus(z) at every z."""
    return torch.expm1(softplus.clamp(min=_SOFTPLUS_FLOOR).neg_())


def _gaussian(v: Tensor) -> Tensor:
    """exp(-v^2 / 2), 0 from v^2 / 2 = 50 on."""
    return torch.nn.functional.threshold_(v.square().mul_(-0.5).exp_(), _GAUSSIAN_FLOOR, 0.0)


def _divisor(std: Tensor, eps: float) -> Tensor:
    return std if eps >= _EPS_WITHOUT_GUARD else std + 1e-20


def _standardised(clean, noisy, divisor, top_values_NK1, k, negated: bool) -> tuple[Tensor, Tensor]:
    """((clean - threshold) / std, or its negative, and is_in; `divisor` is the std as _divisor guards it. The
    threshold is the noisy (K+1)-th value for an expert in the noisy top k, the K-th for one outside it
    (routers.prob_in_top_k explains why)."""
    thr_in, thr_out = top_values_NK1[:, k:k + 1], top_values_NK1[:, k - 1:k]
    is_in = noisy > thr_in
    thr = torch.where(is_in, thr_in, thr_out)
    diff = torch.sub(thr, clean) if negated else torch.sub(clean, thr)
    return diff.div_(divisor), is_in


def _blocks(*tensors: Tensor | None):
    """The tensors (rows first) a block of rows at a time: on CPU blocks that stay in cache, on a GPU the whole
    tensors as they are (one block, not even a slice). None passes through."""
    n = tensors[0].shape[0]
    rows = policy_for(tensors[0]).gate_chunk_rows
    if rows is None or n <= rows:
        yield tensors
        return
    for start in range(0, n, rows):
        yield tuple(None if t is None else t[start:start + rows] for t in tensors)
