"""Output layers: hidden states -> per-token negative log-likelihood (--softmax full|sampled|adaptive).

Legend (docs/shapes.md): N tokens, D model width (the hidden state), V vocabulary size, S sampled classes
(drawn per batch, shared by all its tokens).

Every layer returns the per-token NLL [N] in float32 and gives 0 for a target equal to IGNORE (-100, as
in F.cross_entropy), so evaluation can leave out tokens it does not count (padding, <S>).
`forward_macs_per_token()` is the layer's training-time forward multiply-adds per token, for the FLOP
accounting (accounting/flops.py counts d*V for the full softmax; the trainer substitutes this value).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_scale.labels import IGNORE


class FullSoftmax(nn.Module):
    """The exact softmax over the whole vocabulary (a linear layer with bias, then log-softmax; the llama block's
    has no bias, as Mixtral's lm_head)."""

    def __init__(self, d_model: int, vocab_size: int, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size, bias=bias)

    def forward(self, h_ND: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        """Per-token NLL [N] in float32."""
        logits_NV = self.proj(h_ND).float()
        return F.cross_entropy(logits_NV, targets_N, reduction="none", ignore_index=IGNORE)

    def log_probs(self, h_ND: torch.Tensor) -> torch.Tensor:
        """log p(word | h) over the whole vocabulary: [N, V] float32 (generation)."""
        return torch.log_softmax(self.proj(h_ND).float(), dim=-1)

    def forward_macs_per_token(self) -> int:
        return self.proj.in_features * self.proj.out_features


class LogUniformSampler:
    """Zipfian proposal over ids sorted by descending frequency: Q(k) = log((k+2)/(k+1)) / log(V+1)
    (TF's log_uniform_candidate_sampler, which Jozefowicz et al. 2016 used); sampled by inverting the CDF."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        k = torch.arange(vocab_size, dtype=torch.float64)
        self.log_q_V = (torch.log((k + 2) / (k + 1)) / math.log(vocab_size + 1)).log().float()

    def sample(self, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
        u = torch.rand(num, dtype=torch.float64, generator=generator)
        ids = torch.floor(torch.exp(u * math.log(self.vocab_size + 1))).long() - 1
        return ids.clamp_(0, self.vocab_size - 1)


class UnigramSampler:
    """Proposal proportional to the training counts (every word gets at least a count of 1, so every class
    can be drawn and the logit correction stays finite)."""

    def __init__(self, counts_V: torch.Tensor):
        probs = counts_V.double().clamp(min=1.0)
        probs = probs / probs.sum()
        self.vocab_size = probs.numel()
        self.probs_V, self.log_q_V = probs, probs.log().float()

    def sample(self, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.multinomial(self.probs_V, num, replacement=True, generator=generator)


class SampledSoftmax(nn.Module):
    """Importance-sampled softmax (Jean et al. 2015; Jozefowicz et al. 2016) for training; exact at eval.

    Training: S classes are drawn with replacement from the proposal Q, shared by every token of the batch.
    Each token's loss is the cross-entropy of its target among [target, S samples] with every logit
    corrected by -log(S*Q(class)) (the expected count of that class among the samples). The correction
    makes sum_s exp(z_s)/(S*Q(s)) an unbiased estimate of the full partition function; the corrected target
    term exp(z_t)/(S*Q(t)) vanishes as S grows, so the gradient converges to the full softmax's (consistent;
    biased for finite S because the log of an unbiased sum is not unbiased). Samples equal to the target
    ("accidental hits") are kept on purpose: TF's remove_accidental_hits drops the target's share of the
    partition function, and the gradient then converges to a softmax over the other words (off by p_target,
    measured in tests/models/test_softmax.py). In eval mode (model.eval()) it is the exact full softmax.
    """

    def __init__(self, d_model: int, vocab_size: int, num_sampled: int, sampler, proj: nn.Linear | None = None):
        """`proj`: an existing output layer to train (e.g. the model's full softmax's), else a new one."""
        super().__init__()
        if sampler.vocab_size != vocab_size:
            raise ValueError(f"sampler over {sampler.vocab_size} classes for a vocabulary of {vocab_size}")
        self.proj = proj if proj is not None else nn.Linear(d_model, vocab_size)
        self.num_sampled, self.sampler = num_sampled, sampler
        self.generator: torch.Generator | None = None   # None: the global RNG (seeded per step by the trainer)
        self._log_q_on: dict[torch.device, torch.Tensor] = {}

    def _log_q(self, device: torch.device) -> torch.Tensor:
        if device not in self._log_q_on:   # copied to the device once, not every step
            self._log_q_on[device] = self.sampler.log_q_V.to(device)
        return self._log_q_on[device]

    def forward(self, h_ND: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.exact_nll(h_ND, targets_N)
        counted_N = targets_N != IGNORE
        safe_targets_N = torch.where(counted_N, targets_N, torch.zeros_like(targets_N))
        sampled_S = self.sampler.sample(self.num_sampled, self.generator).to(targets_N.device)
        log_q_V = self._log_q(h_ND.device)
        log_expected_S = log_q_V[sampled_S] + math.log(self.num_sampled)
        log_expected_N = log_q_V[safe_targets_N] + math.log(self.num_sampled)
        w_true_ND, w_sampled_SD, b_true_N, b_sampled_S = self.class_rows(safe_targets_N, sampled_S)
        h = h_ND.float()
        true_N = (h * w_true_ND.float()).sum(-1)
        sampled_NS = h @ w_sampled_SD.float().t()
        if b_true_N is not None:   # the llama block's output layer has none
            true_N, sampled_NS = true_N + b_true_N.float(), sampled_NS + b_sampled_S.float()
        true_N, sampled_NS = true_N - log_expected_N, sampled_NS - log_expected_S
        logits_N1S = torch.cat([true_N[:, None], sampled_NS], dim=1)
        nll_N = torch.logsumexp(logits_N1S, dim=1) - true_N
        return torch.where(counted_N, nll_N, torch.zeros_like(nll_N))

    def class_rows(self, targets_N: torch.Tensor, sampled_S: torch.Tensor):
        """The output layer's rows (and biases; None without) of the targets and of the samples."""
        w, b = self.proj.weight, self.proj.bias
        if b is None:
            return w[targets_N], w[sampled_S], None, None
        return w[targets_N], w[sampled_S], b[targets_N], b[sampled_S]

    def exact_nll(self, h_ND: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        logits_NV = self.proj(h_ND).float()
        return F.cross_entropy(logits_NV, targets_N, reduction="none", ignore_index=IGNORE)

    def log_probs(self, h_ND: torch.Tensor) -> torch.Tensor:
        """The exact distribution (as at eval): [N, V] float32."""
        return torch.log_softmax(self.proj(h_ND).float(), dim=-1)

    def forward_macs_per_token(self) -> int:
        return self.proj.in_features * (self.num_sampled + 1)


class AdaptiveSoftmax(nn.Module):
    """Adaptive softmax (Grave et al. 2017), PyTorch's nn.AdaptiveLogSoftmaxWithLoss: a head over the
    `cutoffs[0]` most frequent words plus one entry per tail cluster, each tail a D -> D/4^(i+1) -> |cluster|
    projection. Exact (a proper distribution over V); ids must be sorted by descending frequency, as Vocab's are."""

    def __init__(self, d_model: int, vocab_size: int, cutoffs: list[int], cluster_shares: list[float] | None = None,
                 div_value: float = 4.0):
        super().__init__()
        self.inner = nn.AdaptiveLogSoftmaxWithLoss(d_model, vocab_size, cutoffs, div_value=div_value, head_bias=True)
        bounds = [0, *cutoffs, vocab_size]
        sizes = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
        # share of target tokens falling in each tail cluster: from unigram counts when known, else by size
        self.cluster_shares = cluster_shares or [s / vocab_size for s in sizes[1:]]

    def forward(self, h_ND: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        counted_N = targets_N != IGNORE
        safe_targets_N = torch.where(counted_N, targets_N, torch.zeros_like(targets_N))
        logprob_N = self.inner(h_ND.float(), safe_targets_N).output
        return torch.where(counted_N, -logprob_N, torch.zeros_like(logprob_N))

    def log_probs(self, h_ND: torch.Tensor) -> torch.Tensor:
        return self.inner.log_prob(h_ND.float())

    def forward_macs_per_token(self) -> float:
        """Head for every token, tail i for the share of tokens whose target lies in cluster i."""
        inner = self.inner
        macs = float(inner.in_features * inner.head_size)
        for share, tail in zip(self.cluster_shares, inner.tail):
            down, up = tail[0], tail[1]
            macs += share * (down.in_features * down.out_features + up.in_features * up.out_features)
        return macs


def cluster_shares_from_counts(counts_V: list[int], cutoffs: list[int]) -> list[float]:
    total = float(sum(counts_V)) or 1.0
    bounds = [*cutoffs, len(counts_V)]
    return [sum(counts_V[lo:hi]) / total for lo, hi in zip(bounds[:-1], bounds[1:])]
