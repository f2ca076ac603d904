"""The model a config asks for (`--model lstm|transformer`), its FLOP accounting and its parameter count."""

from __future__ import annotations

from torch import nn

from moe_scale.config import RunConfig
from moe_scale.errors import UserError


def build_model(config: RunConfig, vocab_size: int, ep_size: int = 1, ep_rank: int = 0, seed: int = 0,
                counts: list[int] | None = None, world: int = 1, rank: int = 0) -> nn.Module:
    """The model with its --softmax; `counts`: the vocabulary's training counts (vocab.counts), which the unigram
    sampler needs. Process `rank` of `world` (> 1) with --vocab-exchange rows holds its rows of the vocabulary
    tables (models/vocab_parallel.py)."""
    model = _build(config, vocab_size, ep_size, ep_rank, seed, counts)
    if world > 1 and config.parallel.vocab_exchange == "rows":
        from moe_scale.models.vocab_parallel import VocabRows, shard_vocabulary

        try:
            rows = VocabRows(vocab_size, world, rank)
        except ValueError as e:
            raise UserError(f"{e}; use --vocab-exchange dense") from None
        shard_vocabulary(model, rows)
    return model


def _build(config: RunConfig, vocab_size: int, ep_size: int, ep_rank: int, seed: int,
           counts: list[int] | None) -> nn.Module:
    if config.model.kind == "transformer":
        from moe_scale.models.transformer_lm import TransformerLM

        moa_experts = config.attention.moa.num_experts
        if config.attention.kind == "moa" and moa_experts % ep_size:
            raise UserError(f"{moa_experts} attention experts cannot be split over {ep_size} expert-parallel "
                            f"processes; launch a number of processes that divides --moa-num-experts")
        return TransformerLM(config, vocab_size, ep_size=ep_size, ep_rank=ep_rank, seed=seed, counts=counts)
    from moe_scale.models.lstm_lm import LSTMMoELM

    return LSTMMoELM(config, vocab_size, ep_size=ep_size, ep_rank=ep_rank, seed=seed, counts=counts)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """{"total", "experts"}: every expert (and what is sharded with the experts, e.g. the hierarchical gate's
    secondary matrices) counted once over all expert-parallel ranks, and the vocabulary tables whole where each
    rank holds some of their rows."""
    from moe_scale.models.vocab_parallel import vocabulary_shards

    local_sharded = total_sharded = total_expert = 0
    for shard in vocabulary_shards(model).values():
        local_sharded += shard.param.numel()
        total_sharded += shard.param[0].numel() * shard.total
    for layer in model.moe_layers():
        for name, shard in layer.expert_shards().items():
            n = shard.param.numel()
            local_sharded += n
            total_sharded += n * layer.ep_size
            total_expert += n * layer.ep_size if name.startswith("experts.") else 0
    dense = sum(p.numel() for p in model.parameters()) - local_sharded
    return {"total": dense + total_sharded, "experts": total_expert}


def describe_parameters(model: nn.Module) -> str:
    """The run-start line's '0.33M parameters (0.03M in 8 experts × 2 layers)': the experts of a layer and the
    layers that have them, never their product (16 experts reads as one layer's choice among 16); MoA's attention
    experts apart from the FFN's ('4 attention experts × 2 layers + 8 experts × 2 layers')."""
    counts = parameter_counts(model)
    layers = model.moe_layers()
    if not layers:
        return f"{counts['total'] / 1e6:.2f}M parameters"
    attention = {id(module) for module in getattr(model, "attention_layers", list)()}
    groups: dict[tuple[str, int], int] = {}
    for layer in layers:
        kind = "attention " if id(layer) in attention else ""
        groups[kind, layer.num_experts] = groups.get((kind, layer.num_experts), 0) + 1
    parts = [f"{experts} {kind}experts" + (f" × {n} layers" if n > 1 else "")
             for (kind, experts), n in groups.items()]
    return f"{counts['total'] / 1e6:.2f}M parameters ({counts['experts'] / 1e6:.2f}M in {' + '.join(parts)})"
