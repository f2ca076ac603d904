"""Balancing losses of the sparsely-gated MoE (Shazeer et al. 2017, eq. 6-7 and 11; spec §1.4).

Legend: E experts.
"""

import torch

_EPS = 1e-10  # the t2t epsilons: keep an empty or all-zero vector finite


def cv_squared(v: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation of ``v`` (e.g. ``importance_E`` or ``load_E``), exactly as t2t; of each
    row for ``[..., E]`` (so both balance vectors, stacked, cost one computation).

    Uses the *population* variance (divide by n, not n-1), so a one-hot vector of length n gives n-1.
    ``torch.var`` is unbiased and would be n/(n-1) times larger; the paper's Table 6 is on this scale.
    Computed in float32 at least, because the loss must not round away in fp16/bf16.
    """
    v = v.float() if v.dtype in (torch.float16, torch.bfloat16) else v
    size = v.shape[-1] + _EPS
    mean = v.sum(-1, keepdim=True) / size
    var = ((v - mean) ** 2).sum(-1) / size
    return var / (mean.squeeze(-1) ** 2 + _EPS)


class _BalanceLoss(torch.autograd.Function):
    """sum_r w_r cv_squared(stats[r]) over the rows of stats [rows, experts], with its gradient written out: on a
    GPU every operation is a kernel launch, and autograd through cv_squared takes about 20 for two rows, this 8.
    The mean divides by E, not E + 1e-10 (equal in float32; 1e-10 / E apart in float64)."""

    @staticmethod
    def forward(ctx, stats: torch.Tensor, weights: tuple[float, ...]) -> torch.Tensor:
        var, mean = torch.var_mean(stats, dim=-1, correction=0)
        denom = mean.square().add_(_EPS)
        cv2 = var / denom
        ctx.weights = weights
        ctx.save_for_backward(stats, var, mean, denom)
        loss = cv2[0] * weights[0]
        for r in range(1, len(weights)):
            loss = torch.add(loss, cv2[r], alpha=weights[r])
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # d cv2 / d v_i = 2 / (E denom) * ((v_i - mean) - var mean / denom)
        stats, var, mean, denom = ctx.saved_tensors
        shift = (var * mean / denom)[:, None]
        grad_stats = (stats - mean[:, None]).sub_(shift).mul_((grad * (2.0 / stats.shape[-1]) / denom)[:, None])
        weights = ctx.weights
        if len(set(weights)) == 1:
            grad_stats.mul_(weights[0])
        else:
            for r, w in enumerate(weights):
                grad_stats[r].mul_(w)
        return grad_stats, None


def balance_loss(stats: torch.Tensor, weights: tuple[float, ...]) -> torch.Tensor:
    """sum over rows r of weights[r] * cv_squared(stats[r]): a gate's balancing loss from its stacked statistics
    (e.g. importance and load, eq. 6-7 and 11), in float32 at least."""
    if stats.dim() != 2 or stats.shape[0] != len(weights):
        raise ValueError(f"balance_loss: {len(weights)} weights for statistics of shape {tuple(stats.shape)}")
    stats = stats.float() if stats.dtype in (torch.float16, torch.bfloat16) else stats
    return _BalanceLoss.apply(stats, tuple(float(w) for w in weights))
