"""Rotary position embeddings (Su et al. 2021, RoFormer) as Llama and Mixtral apply them: the llama block's
positions, applied to queries and keys inside attention (attention/mha.py).

Legend (docs/shapes.md): B sequences, H attention heads, T positions, d head width.

Position p rotates each pair (i, i + d/2) of a head's dimensions by the angle p·θ^(-2i/d), i < d/2 (transformers'
`rotate_half` convention, not interleaved pairs), computed as transformers computes it (inverse frequencies in
float32 on the host, cos and sin in float32, then the activations' dtype), so an exported model's logits match.
"""

from __future__ import annotations

import torch


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """θ^(-2i/d) for i < d/2, float32: MixtralRotaryEmbedding.compute_default_rope_parameters."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))


class RotaryPositions(torch.nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions rotate pairs of dimensions: head width {head_dim} must be even")
        self.head_dim, self.theta = head_dim, theta
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}   # not a buffer: nothing to save or load

    def cos_sin(self, start: int, T: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, d] of positions start..start+T-1."""
        positions_T = torch.arange(start, start + T, device=device, dtype=torch.float)
        if positions_T.device not in self._inv_freq_on:   # computed on the host, copied to a device once
            self._inv_freq_on[positions_T.device] = inverse_frequencies(self.head_dim, self.theta).to(device)
        freqs_Td2 = positions_T[:, None] * self._inv_freq_on[positions_T.device][None, :]
        angles_Td = torch.cat((freqs_Td2, freqs_Td2), dim=-1)
        return angles_Td.cos().to(dtype), angles_Td.sin().to(dtype)

    def forward(self, q_BHTd: torch.Tensor, k_BHTd: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys of positions start..start+T-1, rotated."""
        cos_Td, sin_Td = self.cos_sin(start, q_BHTd.shape[2], q_BHTd.device, q_BHTd.dtype)
        return q_BHTd * cos_Td + _rotate_half(q_BHTd) * sin_Td, k_BHTd * cos_Td + _rotate_half(k_BHTd) * sin_Td

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta:g}"


def _rotate_half(x_BHTd: torch.Tensor) -> torch.Tensor:
    half = x_BHTd.shape[-1] // 2
    return torch.cat((-x_BHTd[..., half:], x_BHTd[..., :half]), dim=-1)
