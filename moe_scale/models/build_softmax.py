"""The output layer a config asks for (--softmax full | sampled | adaptive); its settings are validated in config.py."""

from __future__ import annotations

from torch import nn

from moe_scale.config import SoftmaxConfig, parse_cutoffs
from moe_scale.errors import UserError
from moe_scale.models.softmax import (AdaptiveSoftmax, FullSoftmax, LogUniformSampler, SampledSoftmax,
                                      UnigramSampler, cluster_shares_from_counts)


def build_softmax(config: SoftmaxConfig, full: FullSoftmax, counts: list[int] | None) -> nn.Module:
    """The --softmax layer. `full` is the model's FullSoftmax: the sampled softmax reuses its parameters (it is
    the same model, only trained with a cheaper loss), so building it draws no random numbers."""
    d_model, vocab_size = full.proj.in_features, full.proj.out_features
    if config.kind == "full":
        return full
    if config.kind == "sampled":
        if config.sampler == "unigram":
            if counts is None:
                raise UserError("--sampler unigram needs the training counts of every token, which only "
                                "--tokenizer words keeps (vocab.counts beside the vocabulary); use --sampler "
                                "log_uniform, or --tokenizer words")
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
