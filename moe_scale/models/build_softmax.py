"""The output layer a config asks for (--softmax full | sampled | adaptive); its settings are validated in config.py."""

from __future__ import annotations

from torch import nn

from moe_scale.config import UNIGRAM_NEEDS_WORD_COUNTS, SoftmaxConfig, parse_cutoffs
from moe_scale.errors import UserError
from moe_scale.models.softmax import (AdaptiveSoftmax, FullSoftmax, LogUniformSampler, SampledSoftmax,
                                      UnigramSampler, cluster_shares_from_counts)


def build_softmax(config: SoftmaxConfig, d_model: int, vocab_size: int, counts: list[int] | None,
                  bias: bool = True) -> nn.Module:
    """The --softmax layer from `d_model` hidden units to `vocab_size` classes; `counts` are the training
    occurrences per id (vocab.counts: the unigram sampler draws from them, the adaptive softmax's FLOP count
    weighs its clusters by them), None where unknown. The full softmax's projection is built first whatever the
    kind: the sampled softmax trains it (the same model, only a cheaper loss), and the adaptive softmax, which
    does not use it, is initialised after it, so that a seed gives the initial weights it gave runs already
    trained. `bias=False`: an output matrix without bias (the llama block's; full and sampled only)."""
    full = FullSoftmax(d_model, vocab_size, bias)
    if config.kind == "full":
        return full
    if config.kind == "sampled":
        if config.sampler == "unigram":
            if counts is None:
                raise UserError(UNIGRAM_NEEDS_WORD_COUNTS)
            import torch
            sampler = UnigramSampler(torch.tensor(counts))
        else:
            sampler = LogUniformSampler(vocab_size)
        return SampledSoftmax(d_model, vocab_size, config.num_sampled, sampler, proj=full.proj)
    cutoffs = parse_cutoffs(config.adaptive_cutoffs)
    if cutoffs[-1] >= vocab_size:
        raise UserError(f"--adaptive-cutoffs {config.adaptive_cutoffs}: the last cutoff must be below the "
                        f"vocabulary size {vocab_size}")
    shares = cluster_shares_from_counts(counts, cutoffs) if counts else None
    return AdaptiveSoftmax(d_model, vocab_size, cutoffs, cluster_shares=shares)
