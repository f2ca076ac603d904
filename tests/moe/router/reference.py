"""The noisy gate's logits by plain autograd (spec §1.2): the reference the router's fused op is checked against."""

import torch
import torch.nn.functional as F


def noisy_logits(router, x_ND, noise_NE):
    """(clean_NE, noisy_NE, std_NE) of a NoisyTopKRouter for the given standard-normal noise; std includes eps."""
    dtype = torch.promote_types(x_ND.dtype, torch.float32)
    x_ND = x_ND.to(dtype)
    clean_NE = x_ND @ router.w_gate.to(dtype)
    std_NE = F.softplus(x_ND @ router.w_noise.to(dtype)) + router.noise_epsilon
    return clean_NE, clean_NE + noise_NE.to(dtype) * std_NE, std_NE
