"""Decoder-only (causal) transformer language model with a choice of attention and feed-forward per block.

Legend (docs/shapes.md): B sequences, T positions, N tokens (B·T), D model width.

    embedding + sinusoidal positions ─▶ N × [x + Att(LN(x)),  x + FFN(LN(x))] ─▶ LN ─▶ softmax

Att: multi-head with head masks (mha), MoA attention experts (moa) or MAE (mae); FFN: dense (GELU) or an
MoE layer with any `--gate`. Pre-LayerNorm blocks; dropout on every sub-layer output. Legend: B sequences,
T positions, D model dim, V vocabulary. Interface as the LSTM model: `moe_layers()` and `LMOutput`.

`--block llama` is Mixtral's decoder (Llama's with a dense FFN), module for module what transformers'
MixtralForCausalLM computes, so it exports natively (weights/hf_native.py); each block kind is a class of
models/blocks.py:

    embedding ─▶ N × [x + Att(RMSNorm(x)),  x + FFN(RMSNorm(x))] ─▶ RMSNorm ─▶ lm_head (no bias; tied or not)

Att: multi-head attention without biases, rotary positions on queries and keys; FFN: SwiGLU (dense, or SwiGLU
experts behind Mixtral's router: softmax top-k, gates renormalised). Every matrix but the router's and the
experts' (which draw their own) starts N(0, 0.02²) as transformers initialises Mixtral; dropout as the default
block's (training only).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_scale.config import RunConfig
from moe_scale.models.blocks import block_kind
from moe_scale.models.build_softmax import build_softmax
from moe_scale.models.lstm_lm import LMOutput
from moe_scale.moe.build import build_moe_layer
from moe_scale.moe.deepspeed_adapter import ExpertParallelModule
from moe_scale.moe.layer import MoELayer


def sinusoidal_positions(T: int, d: int, device=None) -> torch.Tensor:
    position_T1 = torch.arange(T, device=device, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, d, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / d))
    table_TD = torch.zeros(T, d, device=device)
    table_TD[:, 0::2] = torch.sin(position_T1 * frequency)
    table_TD[:, 1::2] = torch.cos(position_T1 * frequency[: d // 2])
    return table_TD


class Block(nn.Module):
    def __init__(self, config: RunConfig, ep_size: int, ep_rank: int, seed: int):
        """Built from config.attention, config.model (width, dropout, config.model.transformer) and config.moe, as
        its kind (models/blocks.py) builds each part."""
        super().__init__()
        kind, d, transformer = block_kind(config), config.model.d_model, config.model.transformer
        self.attention_kind = config.attention.kind
        self.attn = kind.attention(config, ep_size, ep_rank, seed)
        if transformer.ffn == "dense":
            self.ffn = kind.dense_ffn(d, transformer.ffn_hidden)
        else:
            self.ffn = build_moe_layer(config.moe, d, ep_size=ep_size, ep_rank=ep_rank, seed=seed + 1,
                                       kind=config.expert_kind)
            kind.check_experts(self.ffn, config)
        self.norm1, self.norm2 = kind.norm(d, config), kind.norm(d, config)
        self.dropout = nn.Dropout(config.model.dropout)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # every attention returns (y, its balancing loss or None); the block's routed losses are summed without a
        # zero to start from
        attended, aux = self.attn(self.norm1(x_BTD))
        x_BTD = x_BTD + self.dropout(attended)
        B, T, D = x_BTD.shape
        normed = self.norm2(x_BTD)
        if isinstance(self.ffn, MoELayer):
            ffn_ND, ffn_aux = self.ffn(normed.reshape(B * T, D), seq_len=T)
            aux = ffn_aux if aux is None else aux + ffn_aux
            ffn_out = ffn_ND.view(B, T, D)
        else:
            ffn_out = self.ffn(normed)
        return x_BTD + self.dropout(ffn_out), x_BTD.new_zeros((), dtype=torch.float32) if aux is None else aux


    def decode(self, x_BTD: torch.Tensor, cache: dict) -> torch.Tensor:
        """Generation (eval mode): forward() for new positions, the attention reading its cache."""
        x_BTD = x_BTD + self.attn.decode(self.norm1(x_BTD), cache)
        B, T, D = x_BTD.shape
        normed = self.norm2(x_BTD)
        if isinstance(self.ffn, MoELayer):
            return x_BTD + self.ffn(normed.reshape(B * T, D))[0].view(B, T, D)
        return x_BTD + self.ffn(normed)


class TransformerLM(nn.Module):
    def __init__(self, config: RunConfig, vocab_size: int, ep_size: int = 1, ep_rank: int = 0, seed: int = 0,
                 counts: list[int] | None = None):
        """Its softmax from config.softmax (`counts`: the vocabulary's training counts, models/build_softmax.py).
        `ep_rank` selects which experts (attention and FFN) this process holds; `seed` seeds the experts' init
        (the rest uses the global RNG, which the caller seeds identically on every rank)."""
        super().__init__()
        self.d_model = d = config.model.d_model
        self.block_kind = kind = block_kind(config)
        self.embedding = nn.Embedding(vocab_size, d)
        self.blocks = nn.ModuleList(Block(config, ep_size, ep_rank, seed + 2 * i)
                                    for i in range(config.model.transformer.num_layers))
        self.final_norm = kind.norm(d, config)
        self.dropout = nn.Dropout(config.model.dropout)
        self.softmax = build_softmax(config.softmax, d, vocab_size, counts, bias=kind.output_bias)
        self.position_table: torch.Tensor | None = None   # sinusoidal positions, made once (not saved)
        kind.init(self, config)

    def positions(self, T: int, like: torch.Tensor) -> torch.Tensor:
        """The sinusoidal positions of the first T positions [T, D], in like's dtype and on its device: computed
        when a longer sequence or another device or dtype comes, else a slice of the last table (each row depends
        on its position only)."""
        table = self.position_table
        if table is None or table.shape[0] < T or table.device != like.device or table.dtype != like.dtype:
            with torch.inference_mode(False):   # (made during generation, read in training too)
                table = self.position_table = sinusoidal_positions(T, self.d_model, like.device).to(like.dtype)
        return table[:T]

    def moe_layers(self) -> list[MoELayer]:
        """Every expert layer (MoA attention and MoE FFNs), in forward order."""
        return [m for m in self.modules() if isinstance(m, ExpertParallelModule)]

    def attention_layers(self) -> list[nn.Module]:
        return [block.attn for block in self.blocks]

    def forward(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> LMOutput:
        B, T = inputs_BT.shape
        x_BTD = self.embedding(inputs_BT)
        if not self.block_kind.rotary:   # rotary positions are inside attention
            x_BTD = x_BTD + self.positions(T, x_BTD)
        x_BTD = self.dropout(x_BTD)
        aux = None
        for block in self.blocks:
            x_BTD, block_aux = block(x_BTD)
            aux = block_aux if aux is None else aux + block_aux
        aux = x_BTD.new_zeros((), dtype=torch.float32) if aux is None else aux
        nll_N = self.softmax(self.final_norm(x_BTD).reshape(B * T, -1), targets_BT.reshape(-1))
        return LMOutput(nll_N.sum(), B * T, aux)

    @torch.no_grad()
    def decode(self, inputs_BT: torch.Tensor, cache: dict | None = None) -> tuple[torch.Tensor, dict]:
        """Generation (eval mode): log p(next word) after each input position [B, T, V], continuing from `cache`
        (every layer's keys and values of the earlier positions; None: the start), and the extended cache.
        Each new word costs one position of every layer, never a re-run of the prefix."""
        B, T = inputs_BT.shape
        cache = cache or {"length": 0, "layers": [{} for _ in self.blocks]}
        start = cache["length"]
        x_BTD = self.embedding(inputs_BT)
        if not self.block_kind.rotary:
            x_BTD = x_BTD + self.positions(start + T, x_BTD)[start:]
        for block, layer_cache in zip(self.blocks, cache["layers"]):
            x_BTD = block.decode(x_BTD, layer_cache)
        cache["length"] = start + T
        return self.softmax.log_probs(self.final_norm(x_BTD).reshape(B * T, -1)).view(B, T, -1), cache
