"""The large-scale options (--softmax, --optimizer, --stream ...): their validation and the softmax builder."""

from __future__ import annotations

from torch import nn

from moe_scale.errors import UserError
from moe_scale.models.softmax import (AdaptiveSoftmax, FullSoftmax, LogUniformSampler, SampledSoftmax,
                                      UnigramSampler, cluster_shares_from_counts)


def parse_cutoffs(text: str) -> list[int]:
    try:
        cutoffs = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--adaptive-cutoffs {text!r} is not a comma-separated list of integers; "
                        "use e.g. --adaptive-cutoffs 2000,10000") from None
    if not cutoffs or any(b <= a for a, b in zip(cutoffs, cutoffs[1:])) or cutoffs[0] < 1:
        raise UserError(f"--adaptive-cutoffs {text!r} must be increasing positive word ids, e.g. 2000,10000")
    return cutoffs


def validate_scale_options(config) -> None:
    t, d = config.train, config.data
    if t.softmax == "sampled" and t.num_sampled < 1:
        raise UserError(f"--num-sampled must be at least 1 (got {t.num_sampled})")
    if t.softmax == "sampled" and t.num_sampled >= d.vocab_size:
        raise UserError(f"--num-sampled {t.num_sampled} is not smaller than --vocab-size {d.vocab_size}; "
                        "sample fewer classes or use --softmax full")
    if t.softmax == "adaptive":
        cutoffs = parse_cutoffs(t.adaptive_cutoffs)
        if cutoffs[-1] >= d.vocab_size:
            raise UserError(f"--adaptive-cutoffs {t.adaptive_cutoffs}: the last cutoff must be below "
                            f"--vocab-size {d.vocab_size}")
    if min(t.shuffle_buffer, t.token_budget) < 0 or t.stream_workers < 1:
        raise UserError("--shuffle-buffer and --token-budget must not be negative and --stream-workers must be "
                        "at least 1")
    if t.token_budget and not t.stream:
        raise UserError("--token-budget needs --stream (one pass over streamed shards); with in-memory data "
                        "use --max-steps")


def build_softmax(train, full: FullSoftmax, counts: list[int] | None) -> nn.Module:
    """The --softmax layer. `full` is the model's FullSoftmax: the sampled softmax reuses its parameters (it is
    the same model, only trained with a cheaper loss), so building it draws no random numbers."""
    d_model, vocab_size = full.proj.in_features, full.proj.out_features
    if train.softmax == "full":
        return full
    if train.softmax == "sampled":
        if train.sampler == "unigram":
            if counts is None:
                raise UserError("--sampler unigram needs the training word counts (vocab.counts beside the "
                                "vocabulary); use --sampler log_uniform or rebuild the vocabulary")
            import torch
            sampler = UnigramSampler(torch.tensor(counts))
        else:
            sampler = LogUniformSampler(vocab_size)
        return SampledSoftmax(d_model, vocab_size, train.num_sampled, sampler, proj=full.proj)
    cutoffs = parse_cutoffs(train.adaptive_cutoffs)
    if cutoffs[-1] >= vocab_size:
        raise UserError(f"--adaptive-cutoffs {train.adaptive_cutoffs}: the last cutoff must be below the "
                        f"vocabulary size {vocab_size}")
    shares = cluster_shares_from_counts(counts, cutoffs) if counts else None
    return AdaptiveSoftmax(d_model, vocab_size, cutoffs, cluster_shares=shares)
