"""Head importance and global head pruning (Michel et al. 2019; spec §5).

Legend (docs/shapes.md): B sequences, T positions, H attention heads of a layer (original count), d head
width.

Importance of head h: I_h = E_x |Σ ctx_h · ∂L/∂ctx_h| — the gradient of the loss with respect to the head's
mask ξ_h (§5.2), read from the per-head context captured before the mask (so a masked head scores 0). By
default |·| is taken per token, as both released codes do ("token"); "example" takes it per sequence (the
paper's wording). Scores are averaged over tokens and, as the paper did, L2-normalised per layer.

Pruning ranks every head of the model together, lowest score first, and removes heads physically
(`MultiHeadAttention.prune_heads`): smaller q/k/v/out matrices, W_o's bias kept whole.

Which layers: MHA layers, and MAE layers (their heads are ordinary heads; the gate keeps scoring all h
original experts and each remaining head keeps its own weight c_j). MoA is not pruned: its "heads" are
routed experts, and removing one changes the router's top-k choice for every token that picked it, so
pruned and masked MoA models differ.
"""

from __future__ import annotations

import torch

from moe_scale.attention.mha import MultiHeadAttention
from moe_scale.errors import UserError

ABS_GRANULARITIES = ("token", "example")


def prunable_layers(model) -> list[MultiHeadAttention]:
    """The multi-head attention of every block (MHA, or the heads inside MAE), in depth order."""
    layers = []
    for attn in model.attention_layers():
        mha = attn if isinstance(attn, MultiHeadAttention) else getattr(attn, "mha", None)
        if not isinstance(mha, MultiHeadAttention):
            raise UserError(f"head pruning works on --attention mha and mae models, not on {type(attn).__name__} "
                            f"layers (MoA's heads are routed experts; see the README)")
        layers.append(mha)
    return layers


def head_importance(model, batches, num_heads: int, abs_granularity: str = "token", device=None) -> torch.Tensor:
    """[layers, num_heads] importance, L2-normalised per layer; pruned heads score 0."""
    if abs_granularity not in ABS_GRANULARITIES:
        raise ValueError(f"abs_granularity must be one of {ABS_GRANULARITIES}")
    layers = prunable_layers(model)
    was_training = model.training
    model.eval()
    scores_by_layer = torch.zeros(len(layers), num_heads, dtype=torch.float64)
    tokens = 0
    for layer in layers:
        layer.capture_context = True
    try:
        with torch.enable_grad():
            for inputs, targets in batches:
                model.zero_grad(set_to_none=True)
                out = model(inputs.to(device), targets.to(device))
                (out.nll_sum / out.num_tokens).backward()   # mean CE per batch, as the BERT code
                tokens += out.num_tokens
                for index, layer in enumerate(layers):
                    if layer.num_heads == 0:
                        continue
                    ctx = layer.context_BTHd
                    per_token_BTH = (ctx.detach() * ctx.grad).sum(-1).double()
                    if abs_granularity == "token":
                        contribution_H = per_token_BTH.abs().sum((0, 1))
                    else:
                        contribution_H = per_token_BTH.sum(1).abs().sum(0)
                    scores_by_layer[index, layer.head_ids] += contribution_H.cpu()
    finally:
        for layer in layers:
            layer.capture_context, layer.context_BTHd = False, None
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    scores_by_layer /= max(tokens, 1)
    return normalise_per_layer(scores_by_layer)


def normalise_per_layer(scores_by_layer: torch.Tensor) -> torch.Tensor:
    return scores_by_layer / (scores_by_layer.norm(dim=1, keepdim=True) + 1e-20)


def heads_to_prune(scores_by_layer: torch.Tensor, count: int, already: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """The `count` lowest-scoring heads (layer, head) not pruned yet, in a stable global ascending order."""
    order = torch.argsort(scores_by_layer.reshape(-1), stable=True).tolist()
    H = scores_by_layer.shape[1]
    ranked = [(i // H, i % H) for i in order if (i // H, i % H) not in already]
    return ranked[:count]


def apply_pruning(model, heads: list[tuple[int, int]]) -> None:
    """Physically removes (layer, original head id) pairs."""
    layers = prunable_layers(model)
    by_layer: dict[int, set[int]] = {}
    for layer_index, head in heads:
        by_layer.setdefault(layer_index, set()).add(head)
    for layer_index, ids in by_layer.items():
        layers[layer_index].prune_heads(ids)


def apply_masks(model, heads: list[tuple[int, int]]) -> None:
    """Masks (ξ = 0) the (layer, original head id) pairs instead of removing them."""
    layers = prunable_layers(model)
    for layer_index, head in heads:
        layer = layers[layer_index]
        layer.head_mask_H[layer.head_ids.index(head)] = 0.0
