"""What the vocabulary tables move per step when they are split by rows over the P processes of a run
(`--vocab-exchange rows`, P > 1; models/vocab_parallel.py), in place of their gradients' all-reduce.

Per micro-batch of n tokens on a rank, over the P ranks (flat all-to-alls and gathers):

    embedding         the counts (P x 8 bytes each way), the U distinct ids of the batch (8 bytes each) to their
                      owners, U rows of d back; in the backward the U rows' gradients to the owners;
    sampled softmax   the same for the distinct classes among the n targets and the S samples (rows of d + 1 with
                      a bias);
    full softmax      the counts (P x 8 bytes, all-reduced), an all-gather of every rank's hidden states (P·n rows
                      of d: each rank receives (P - 1)·n) and targets, and in the backward an all-reduce of the
                      states' gradients; all-reduces of P·n floats (the logits' maximum, the partition sums, the
                      target logits, and their gradients');
    adaptive softmax  the full softmax's moves per tail cluster i, for the share s_i of the tokens whose targets lie
                      in it (P·n·s_i rows of the tail's width d / 4^(i+1)); the head stays whole.

U, the distinct words among n tokens, is the expectation under a Zipf law (exponent 1, word ids by descending
frequency, as the 1B-word corpus's are close to): E[U] = Σ_v 1 - (1 - p_v)^n with p_v = 1 / (v H_V). The log-uniform
proposal the sampled softmax draws from is Zipfian too, so targets and samples are counted as n + S such draws, and
a tail cluster [a, b) holds the share (H_b - H_a) / H_V of the targets.
"""

from __future__ import annotations

import functools

import torch

from moe_scale.config import parse_cutoffs

COUNT_BYTES, ID_BYTES = 8, 8


@functools.lru_cache(maxsize=256)
def expected_distinct(vocab: int, draws: float) -> float:
    """E[distinct ids] among `draws` tokens drawn from a Zipf(1) law over `vocab` ids."""
    if draws <= 0:
        return 0.0
    v = torch.arange(1, vocab + 1, dtype=torch.float64)
    p = 1.0 / v
    p /= p.sum()
    return float((-torch.expm1(draws * torch.log1p(-p))).sum())


def zipf_share(vocab: int, low: int, high: int) -> float:
    """The share of Zipf(1) draws over `vocab` ids that fall in ids [low, high)."""
    harmonic = torch.cumsum(1.0 / torch.arange(1, vocab + 1, dtype=torch.float64), 0)
    below = float(harmonic[low - 1]) if low > 0 else 0.0
    return (float(harmonic[high - 1]) - below) / float(harmonic[-1])


def rows_split(config, world: int) -> bool:
    """Whether `train` would split the vocabulary tables of this config over its `world` processes."""
    return world > 1 and config.parallel.vocab_exchange == "rows"


def exchanges(config, vocab: int, world: int, tokens: float, value: int) -> list[tuple[str, float]]:
    """The split tables' collectives in one micro-batch of `tokens` per rank: (kind, bytes per rank), kind
    "all_to_all" (bytes a rank sends), "all_gather" (bytes of the gathered whole) or "all_reduce" (bytes reduced)."""
    if not rows_split(config, world):
        return []
    d, P = config.model.d_model, world
    counts = ("all_to_all", P * COUNT_BYTES)

    def fetch(ids: float, width: int) -> list[tuple[str, float]]:
        return [counts, ("all_to_all", ids * ID_BYTES), ("all_to_all", ids * width * value),   # forward
                ("all_to_all", ids * width * value)]                                         # backward

    moves = fetch(expected_distinct(vocab, tokens), d)
    softmax = config.softmax
    from moe_scale.models.blocks import block_kind

    bias = 1 if config.model.kind != "transformer" or block_kind(config).output_bias else 0
    if softmax.kind == "sampled":
        moves += fetch(expected_distinct(vocab, tokens + softmax.num_sampled), d + bias)
    elif softmax.kind == "full":
        moves += _gathered_softmax(P, P * tokens, d, value)
    elif softmax.kind == "adaptive":
        bounds = [*parse_cutoffs(softmax.adaptive_cutoffs), vocab]
        for i, (low, high) in enumerate(zip(bounds[:-1], bounds[1:])):
            moves += _gathered_softmax(P, P * tokens * zipf_share(vocab, low, high), int(d // 4 ** (i + 1)), value)
    return moves


def _gathered_softmax(P: int, gathered: float, width: int, value: int) -> list[tuple[str, float]]:
    """A row-split output layer's vocabulary-parallel cross-entropy over `gathered` tokens of all ranks."""
    return [("all_reduce", P * COUNT_BYTES), ("all_gather", gathered * width * value), ("all_gather", gathered * 8),
            ("all_reduce", gathered * 4), ("all_reduce", gathered * 4), ("all_reduce", gathered * 4),
            ("all_reduce", gathered * 4), ("all_reduce", gathered * width * value)]
