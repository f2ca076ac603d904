"""Transformer block kinds (`--block`): what differs between the default block and Mixtral's, one class each, found
by name in BLOCKS. A kind owns its norm, its positions (a sinusoidal table added to the embeddings, or rotary inside
attention), its attention and dense FFN, the checks on its experts, its initialisation, whether its output layer has
a bias, and what the accounting and the exporters ask of it.

    default  pre-LayerNorm, sinusoidal positions, MHA / MoA / MAE attention, GELU FFN (with biases)
    llama    Mixtral's decoder (Llama's with a dense FFN): RMSNorm, rotary positions, bias-free MHA (with --qk-norm,
             Qwen3's RMSNorm of each head's queries and keys), SwiGLU FFN, gated experts, transformers' N(0, 0.02²)
             initialisation, no output bias; exports natively
"""

from __future__ import annotations

import torch
from torch import nn

from moe_scale.attention.mae import MAEAttention
from moe_scale.attention.mha import MultiHeadAttention
from moe_scale.attention.moa import MoAAttention
from moe_scale.attention.rotary import RotaryPositions
from moe_scale.config import RouterConfig, RunConfig
from moe_scale.errors import UserError
from moe_scale.models.dense_ffn import GELUFFN, SwiGLUFFN
from moe_scale.models.rms_norm import RMSNorm
from moe_scale.moe.router import build_router

LLAMA_INIT_STD = 0.02   # transformers' initializer_range (MixtralConfig, LlamaConfig)


class BlockKind:
    name = ""
    rotary = False            # positions rotate queries and keys inside attention (no table added to the input)
    output_bias = True        # the output layer (softmax) has a bias
    dense_ffn_matrices = 2    # matrices of its dense FFN (the FLOP count)
    exports_natively = False  # transformers' own classes compute it (weights/hf_native.py); else the remote code
    upcycles = False          # its dense FFN is one expert of the block's expert kind (train/upcycle.py)

    def norm(self, d_model: int, config: RunConfig) -> nn.Module:
        raise NotImplementedError

    def attention(self, config: RunConfig, ep_size: int, ep_rank: int, seed: int) -> nn.Module:
        raise NotImplementedError

    def dense_ffn(self, d_model: int, hidden: int) -> nn.Module:
        raise NotImplementedError

    def check_experts(self, layer, config: RunConfig) -> None:
        """Refuses experts the block cannot hold (one line)."""

    def init(self, model: nn.Module, config: RunConfig) -> None:
        """What the model's own construction did not set (after every module is built)."""


class DefaultBlock(BlockKind):
    name = "default"

    def norm(self, d_model, config):
        return nn.LayerNorm(d_model)

    def attention(self, config, ep_size, ep_rank, seed):
        attention, dropout, d = config.attention, config.model.dropout, config.model.d_model
        h = attention.head_width(d)
        if attention.kind == "mha":
            return MultiHeadAttention(d, attention.num_heads, h, dropout)
        if attention.kind == "mae":
            return MAEAttention(d, attention.num_heads, h, dropout)
        # MoA's router: softmax top-k over the attention experts, with the softmax_topk gate's settings
        moa = attention.moa
        router = build_router(RouterConfig(gate="softmax_topk", top_k=moa.top_k,
                                           softmax_topk=config.moe.router.softmax_topk), d, moa.num_experts)
        return MoAAttention(d, h, moa.num_experts, moa.top_k, ep_size=ep_size, ep_rank=ep_rank, seed=seed,
                            router=router, dropout=dropout)

    def dense_ffn(self, d_model, hidden):
        return GELUFFN(d_model, hidden)


class LlamaBlock(BlockKind):
    name = "llama"
    rotary, output_bias, dense_ffn_matrices, exports_natively, upcycles = True, False, 3, True, True

    def norm(self, d_model, config):
        return RMSNorm(d_model, eps=config.model.transformer.rms_norm_eps)

    def attention(self, config, ep_size, ep_rank, seed):
        d, transformer = config.model.d_model, config.model.transformer
        h = config.attention.head_width(d)
        qk_norm = (lambda width: RMSNorm(width, eps=transformer.rms_norm_eps)) if transformer.qk_norm else None
        return MultiHeadAttention(d, config.attention.num_heads, h, config.model.dropout, bias=False,
                                  rotary=RotaryPositions(h, transformer.rope_theta), qk_norm=qk_norm)

    def dense_ffn(self, d_model, hidden):
        return SwiGLUFFN(d_model, hidden)

    def check_experts(self, layer, config):
        if not layer.experts.kind.gated:
            raise UserError(f"--expert-kind {config.expert_kind}: the llama block's experts are gated as "
                            f"Mixtral's (w2(act(w1 x) * w3 x)); pass --expert-kind swiglu or geglu")

    def init(self, model, config):
        """transformers' initialisation of Mixtral: N(0, 0.02²) for the embedding and every Linear (the router
        and the experts, shared ones included, keep their own); a tied output layer is the embedding matrix
        itself."""
        shared = {id(m) for layer in model.moe_layers() if getattr(layer, "shared", None) is not None
                  for m in layer.shared.modules()}
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)) and id(module) not in shared:
                    module.weight.normal_(0.0, LLAMA_INIT_STD)
        if config.model.transformer.tie_embeddings:
            model.softmax.proj.weight = model.embedding.weight


BLOCKS: dict[str, BlockKind] = {kind.name: kind for kind in (DefaultBlock(), LlamaBlock())}


def block_kind(config: RunConfig) -> BlockKind:
    return BLOCKS[config.model.transformer.block]
