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
