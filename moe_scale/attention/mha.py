"""Causal multi-head attention with per-head masks (Michel et al. §2.3), per-token head weights (what MAE's
mixture needs) and physical head pruning (spec §5.4).

Legend (docs/shapes.md): B sequences, T positions, D model width, H attention heads (current, after
pruning), d head width.

A head's output is its context vector ctx_h = softmax(q_h k_hᵀ/√d + causal) v_h, multiplied by
mask_h (0/1, Michel's ξ_h; applied after the softmax and attention dropout, as the BERT fork does) and by an
optional per-token weight, then all heads go through one output projection. Its bias is added once, whatever
heads remain (the BERT fork's `prune_linear_layer` keeps W_o's bias whole). The llama block's attention has no
biases and rotates queries and keys by their positions (attention/rotary.py) before the scores; with --qk-norm
(Qwen3's) each head's queries and keys are RMS-normalised first.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe_scale.attention.rotary import RotaryPositions


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, head_dim: int, dropout: float = 0.0, bias: bool = True,
                 rotary: RotaryPositions | None = None, qk_norm: Callable[[int], nn.Module] | None = None):
        """`bias=False` and `rotary` (rotary positions on queries and keys): the llama block's attention.
        `qk_norm(head_dim)`: the normalisation of every head's queries and keys before the positions (Qwen3's
        `q_norm`, `k_norm`: one each, shared by the heads)."""
        super().__init__()
        self.d_model, self.head_dim, self.dropout, self.bias = d_model, head_dim, dropout, bias
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias)
        self.out_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias)
        self.rotary = rotary
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(head_dim), qk_norm(head_dim)
        else:
            self.q_norm = self.k_norm = None
        # Original index of every head still here: pruning and MAE's gate (which scores the original heads) use it.
        self.head_ids: list[int] = list(range(num_heads))
        self.register_buffer("mask_H", torch.ones(num_heads), persistent=False)
        self.mask_touched = False   # head_mask_H handed out since the last reset: it may hold zeros (or need a grad)
        self.capture_context = False          # keep ctx with its gradient for head importance
        self.context_BTHd: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return len(self.head_ids)

    @property
    def head_mask_H(self) -> torch.Tensor:
        """Michel's ξ per head (1: kept, 0: masked), to read or write. Until someone takes it the forward skips the
        multiplication by all ones (two kernel launches per layer forward, one backward)."""
        self.mask_touched = True
        return self.mask_H

    @head_mask_H.setter
    def head_mask_H(self, mask_H: torch.Tensor) -> None:
        self.mask_touched = True
        self.mask_H = mask_H

    @torch.no_grad()
    def reset_unsaved_buffers(self) -> None:
        """head_mask_H back to all ones (no head masked). It is not saved with the weights (persistent=False), so a
        loader that builds the model empty and fills in only the saved tensors (transformers 5's from_pretrained)
        calls this."""
        self.mask_H.fill_(1.0)
        self.mask_touched = False

    def forward(self, x_BTD: torch.Tensor, head_weights_BTH: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, None]:
        """(output [B, T, D], None: no balancing loss), as every attention of a block returns (y, aux)."""
        return self.attend(x_BTD, head_weights_BTH), None

    def attend(self, x_BTD: torch.Tensor, head_weights_BTH: torch.Tensor | None = None) -> torch.Tensor:
        if self.num_heads == 0:   # every head pruned: only the output bias is left
            return self._no_heads(x_BTD)
        q_BHTd, k_BHTd, v_BHTd = self._queries_keys_values(x_BTD)
        if self.rotary is not None:
            q_BHTd, k_BHTd = self.rotary(q_BHTd, k_BHTd)
        ctx_BTHd = F.scaled_dot_product_attention(
            q_BHTd, k_BHTd, v_BHTd, is_causal=True, dropout_p=self.dropout if self.training else 0.0).transpose(1, 2)
        if self.capture_context and ctx_BTHd.requires_grad:
            ctx_BTHd.retain_grad()
            self.context_BTHd = ctx_BTHd
        return self._output(ctx_BTHd, head_weights_BTH)

    def decode(self, x_BTD: torch.Tensor, cache: dict, head_weights_BTH: torch.Tensor | None = None) -> torch.Tensor:
        """Generation: the new positions x_BTD attend over the keys and values cached for the earlier ones
        (cache["k"], cache["v"]: [B, H, S, d], extended here), as forward() over the whole sequence would."""
        T = x_BTD.shape[1]
        if self.num_heads == 0:
            return self._no_heads(x_BTD)
        q_BHTd, k_BHTd, v_BHTd = self._queries_keys_values(x_BTD)
        if self.rotary is not None:   # the new positions follow the cached ones
            q_BHTd, k_BHTd = self.rotary(q_BHTd, k_BHTd, start=cache["k"].shape[2] if "k" in cache else 0)
        if "k" in cache:
            k_BHTd, v_BHTd = torch.cat([cache["k"], k_BHTd], dim=2), torch.cat([cache["v"], v_BHTd], dim=2)
        cache["k"], cache["v"] = k_BHTd, v_BHTd
        ctx_BTHd = F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd,
                                                  attn_mask=causal_mask(T, k_BHTd.shape[2], x_BTD.device))
        return self._output(ctx_BTHd.transpose(1, 2), head_weights_BTH)

    def _queries_keys_values(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, H, T, d] from one product with the three projections side by side: one GEMM forward and two
        backward instead of three and six (and one bias sum instead of three, no sums of three input gradients),
        for the price of copying the weights side by side. The parameters stay three (checkpoints, pruning)."""
        B, T, _ = x_BTD.shape
        H, d = self.num_heads, self.head_dim
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if self.bias else None
        qkv_BT3Hd = F.linear(x_BTD, weight, bias).view(B, T, 3, H, d)
        q_BTHd, k_BTHd, v_BTHd = qkv_BT3Hd.unbind(2)
        if self.q_norm is not None:
            q_BTHd, k_BTHd = self.q_norm(q_BTHd), self.k_norm(k_BTHd)
        return q_BTHd.transpose(1, 2), k_BTHd.transpose(1, 2), v_BTHd.transpose(1, 2)

    def _no_heads(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """The output once every head is pruned: the output bias, or zeros without biases."""
        B, T, _ = x_BTD.shape
        if self.out_proj.bias is None:
            return x_BTD.new_zeros(B, T, self.d_model)
        return self.out_proj.bias.expand(B, T, self.d_model)

    def _output(self, ctx_BTHd: torch.Tensor, head_weights_BTH: torch.Tensor | None) -> torch.Tensor:
        """Each head's context times its mask (and per-token weight), through the output projection."""
        B, T, H, d = ctx_BTHd.shape
        if not self.mask_touched and head_weights_BTH is None:   # every head kept, unweighted
            return self.out_proj(ctx_BTHd.reshape(B, T, H * d))
        scale_BTH = self.mask_H.to(ctx_BTHd.dtype).expand(B, T, H)
        if head_weights_BTH is not None:
            scale_BTH = scale_BTH * head_weights_BTH.to(ctx_BTHd.dtype)
        return self.out_proj((ctx_BTHd * scale_BTH[..., None]).reshape(B, T, H * d))

    @torch.no_grad()
    def prune_heads(self, original_ids: set[int]) -> None:
        """Physically removes the heads with these original ids: smaller q/k/v/out matrices (spec §5.4)."""
        keep = [i for i, head in enumerate(self.head_ids) if head not in original_ids]
        if len(keep) == self.num_heads:
            return
        d = self.head_dim
        rows = torch.cat([torch.arange(i * d, (i + 1) * d) for i in keep]) if keep else torch.zeros(0, dtype=torch.long)
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self, name)
            new = _linear(self.d_model, len(rows), self.bias).to(old.weight)
            new.weight.copy_(old.weight[rows])
            if self.bias:
                new.bias.copy_(old.bias[rows])
            setattr(self, name, new)
        new_out = _linear(len(rows), self.d_model, self.bias).to(self.out_proj.weight)
        new_out.weight.copy_(self.out_proj.weight[:, rows])
        if self.bias:
            new_out.bias.copy_(self.out_proj.bias)
        self.out_proj = new_out
        self.head_ids = [self.head_ids[i] for i in keep]
        self.mask_H = self.mask_H[keep].clone()

    def extra_repr(self) -> str:
        return f"heads={self.head_ids}, head_dim={self.head_dim}"


def causal_mask(T: int, S: int, device=None) -> torch.Tensor:
    """[T, S] True where the last T of S positions may attend: position S - T + t sees positions 0..S - T + t."""
    return torch.arange(S, device=device)[None, :] <= torch.arange(S - T, S, device=device)[:, None]


def _linear(d_in: int, d_out: int, bias: bool = True) -> nn.Linear:
    """A Linear whose weights are overwritten next; no warning when a layer loses its last head (0 rows)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return nn.Linear(d_in, d_out, bias=bias)
