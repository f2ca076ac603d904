"""RMSNorm (Zhang & Sennrich 2019), the llama block's normalisation, computed as transformers' MixtralRMSNorm /
LlamaRMSNorm computes it: in float32 whatever the activations' dtype, the weight applied after casting back."""

from __future__ import annotations

import torch
from torch import nn

RMS_NORM_EPS = 1e-5   # Mixtral's and Llama 2's rms_norm_eps


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = RMS_NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
