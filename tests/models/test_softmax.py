"""--softmax full | sampled | adaptive: exactness, the sampled softmax's Monte-Carlo gradient, FLOP counts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_scale.config import RunConfig
from moe_scale.errors import UserError
from moe_scale.models.softmax import (IGNORE, AdaptiveSoftmax, FullSoftmax, LogUniformSampler, SampledSoftmax,
                                      UnigramSampler)
from moe_scale.models.build_softmax import build_softmax


def test_full_softmax_is_cross_entropy_and_ignores_ignored_targets():
    torch.manual_seed(0)
    layer = FullSoftmax(8, 30)
    h, targets = torch.randn(5, 8), torch.tensor([1, 29, IGNORE, 0, 7])
    nll = layer(h, targets)
    ref = F.cross_entropy(layer.proj(h), targets.clamp(min=0), reduction="none")
    torch.testing.assert_close(nll[[0, 1, 3, 4]], ref[[0, 1, 3, 4]])
    assert nll[2] == 0
    assert layer.forward_macs_per_token() == 8 * 30


def test_sampled_softmax_is_exact_full_softmax_in_eval_mode():
    torch.manual_seed(0)
    full = FullSoftmax(8, 30)
    sampled = SampledSoftmax(8, 30, 5, LogUniformSampler(30))
    sampled.proj = full.proj
    h, targets = torch.randn(6, 8), torch.randint(0, 30, (6,))
    torch.testing.assert_close(sampled.eval()(h, targets), full(h, targets))
    assert sampled.forward_macs_per_token() == 8 * 6


def test_log_uniform_sampler_draws_its_own_probabilities():
    sampler = LogUniformSampler(20)
    q = sampler.log_q_V.double().exp()
    assert abs(q.sum().item() - 1) < 1e-6
    draws = sampler.sample(200_000, torch.Generator().manual_seed(1))
    freq = torch.bincount(draws, minlength=20).double() / draws.numel()
    se = (q * (1 - q) / draws.numel()).sqrt()
    assert ((freq - q).abs() < 5 * se + 1e-4).all()


def test_unigram_sampler_follows_counts():
    sampler = UnigramSampler(torch.tensor([0, 0, 10, 30, 60]))
    draws = sampler.sample(100_000, torch.Generator().manual_seed(2))
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    expected = torch.tensor([1, 1, 10, 30, 60], dtype=torch.float64) / 102   # zero counts floored at 1
    assert ((freq - expected).abs() < 0.006).all()


class _FixedSampler:
    """Returns a given sample; Q is uniform."""

    def __init__(self, vocab_size, ids):
        self.vocab_size, self.ids = vocab_size, ids
        self.log_q_V = torch.full((vocab_size,), -math.log(vocab_size))

    def sample(self, num, generator=None):
        return self.ids[:num]


def test_sampled_softmax_formula_keeps_accidental_hits():
    torch.manual_seed(0)
    V, S = 10, 4
    samples = [2, 5, 5, 7]
    layer = SampledSoftmax(3, V, S, _FixedSampler(V, torch.tensor(samples)))
    h, targets = torch.randn(2, 3), torch.tensor([5, 1])
    nll = layer.train()(h, targets)
    z = layer.proj(h)
    correction = math.log(S / V)   # log(S * Q), Q = 1/V
    for n, t in enumerate(targets.tolist()):
        logits = torch.stack([z[n, t]] + [z[n, s] for s in samples]) - correction
        torch.testing.assert_close(nll[n], torch.logsumexp(logits, 0) - logits[0])


def _mean_sampled_gradient(layer, h, target, draws, generator):
    """Mean and standard error, over `draws` independent samples, of d(sampled loss)/d(logits) of one token."""
    layer.generator = generator
    grads = []
    for _ in range(draws):
        layer.proj.zero_grad()
        layer(h, target).sum().backward()
        grads.append(layer.proj.bias.grad.clone())   # d loss / d bias == d loss / d logits
    grads = torch.stack(grads).double()
    return grads.mean(0), grads.std(0) / math.sqrt(draws)


def test_sampled_softmax_gradient_converges_to_the_full_softmax_gradient():
    """Monte-Carlo. The sampled loss's gradient w.r.t. the logits, averaged over many independent samples, is
    compared with the exact p - onehot(target). The estimator is consistent, not unbiased: its bias shrinks
    as S grows (measured: max error 0.15 at S=4, 0.016 at S=64, 0.0008 at S=1024 on V=16). At S=1024 it
    must agree within 5 standard errors + 0.002. The test cannot pass trivially: (1) logits are chosen
    anti-correlated with the proposal (rare ids get the high logits), so a missing log(S*Q) correction is
    far off — a negative control that must FAIL the same check; (2) the full gradient is far from zero;
    (3) the error must fall from S=4 to 64 to 1024 (the bias really shrinks with S)."""
    V, D, draws = 16, 4, 2500
    torch.manual_seed(0)
    h = torch.randn(1, D)
    target = torch.tensor([3])
    full = FullSoftmax(D, V)
    with torch.no_grad():
        full.proj.weight.zero_()
        full.proj.bias.copy_(torch.linspace(-1.0, 2.0, V))   # z rises with id: Q (log-uniform) falls with id
    p = torch.softmax(full.proj(h)[0].double(), 0)
    exact = p - F.one_hot(target, V)[0].double()
    assert exact.abs().max() > 0.1

    errors = {}
    for S in (4, 64, 1024):
        layer = SampledSoftmax(D, V, S, LogUniformSampler(V)).train()
        layer.proj = full.proj
        mean, se = _mean_sampled_gradient(layer, h, target, draws, torch.Generator().manual_seed(S))
        errors[S] = (mean - exact).abs().max().item()
    assert ((mean - exact).abs() < 5 * se + 0.002).all(), (mean, exact, se)   # S = 1024
    assert errors[4] > errors[64] > errors[1024]                              # the bias shrinks with S

    # negative control: the same estimator without the log(S*Q) correction (a uniform Q in the correction
    # while sampling from the log-uniform proposal) must fail the same check
    class _Uncorrected(LogUniformSampler):
        def __init__(self, n):
            super().__init__(n)
            self.log_q_V = torch.full((n,), -math.log(n))
    wrong = SampledSoftmax(D, V, 1024, _Uncorrected(V)).train()
    wrong.proj = full.proj
    mean_wrong, se_wrong = _mean_sampled_gradient(wrong, h, target, draws, torch.Generator().manual_seed(7))
    assert ((mean_wrong - exact).abs() > 5 * se_wrong + 0.002).any()


def test_adaptive_softmax_is_a_distribution_and_counts_its_macs():
    torch.manual_seed(0)
    V, D = 40, 16
    layer = AdaptiveSoftmax(D, V, [8, 20], cluster_shares=[0.3, 0.1]).eval()
    h = torch.randn(1, D).expand(V, D)
    nll = layer(h, torch.arange(V))
    assert torch.exp(-nll).sum().item() == pytest.approx(1.0, abs=1e-5)
    assert layer(h[:2], torch.tensor([IGNORE, 3]))[0] == 0
    head = D * (8 + 2)
    tails = 0.3 * (D * 4 + 4 * 12) + 0.1 * (D * 1 + 1 * 20)   # D/4 = 4, D/16 = 1 hidden units
    assert layer.forward_macs_per_token() == pytest.approx(head + tails)


def test_build_softmax_choices_and_their_errors():
    config = RunConfig()
    assert isinstance(build_softmax(config.softmax, 8, 100, None), FullSoftmax)
    config.softmax.kind, config.softmax.num_sampled = "sampled", 10
    sampled = build_softmax(config.softmax, 8, 100, None)
    assert isinstance(sampled, SampledSoftmax) and sampled.proj.weight.shape == (100, 8)
    config.softmax.sampler = "unigram"
    with pytest.raises(UserError, match="--sampler unigram needs"):
        build_softmax(config.softmax, 8, 100, None)
    assert isinstance(build_softmax(config.softmax, 8, 100, list(range(100))).sampler, UnigramSampler)
    config.softmax.kind, config.softmax.adaptive_cutoffs = "adaptive", "10,50"
    assert isinstance(build_softmax(config.softmax, 8, 100, None), AdaptiveSoftmax)
    for cutoffs in ("10,5", "a,b", "10,20000"):
        config.softmax.adaptive_cutoffs = cutoffs
        with pytest.raises(UserError, match="--adaptive-cutoffs"):
            config.validate()
    config.softmax.kind, config.softmax.num_sampled = "sampled", 20000
    with pytest.raises(UserError, match="--num-sampled"):
        config.validate()


def _swapped_in(config: RunConfig, vocab_size: int, counts: list[int]):
    """The model as it was built before it took its softmax from the config: a full softmax, then the configured
    layer put in its place (the sampled one on the full one's projection, the adaptive one drawn after it)."""
    from moe_scale.config import parse_cutoffs
    from moe_scale.models.build import build_model
    from moe_scale.models.softmax import cluster_shares_from_counts

    settings = config.softmax
    kind = settings.kind
    settings.kind = "full"
    model = build_model(config, vocab_size)
    settings.kind = kind
    full = model.softmax
    d_model = full.proj.in_features
    if kind == "sampled":
        sampler = UnigramSampler(torch.tensor(counts)) if settings.sampler == "unigram" \
            else LogUniformSampler(vocab_size)
        model.softmax = SampledSoftmax(d_model, vocab_size, settings.num_sampled, sampler, proj=full.proj)
    elif kind == "adaptive":
        cutoffs = parse_cutoffs(settings.adaptive_cutoffs)
        model.softmax = AdaptiveSoftmax(d_model, vocab_size, cutoffs,
                                        cluster_shares=cluster_shares_from_counts(counts, cutoffs))
    return model


@pytest.mark.parametrize("model", ["lstm", "transformer"])
@pytest.mark.parametrize("softmax", [
    dict(softmax="full"),
    dict(softmax="sampled", num_sampled=10),
    dict(softmax="sampled", num_sampled=10, sampler="unigram"),
    dict(softmax="adaptive", adaptive_cutoffs="10,40"),
], ids=["full", "sampled", "sampled-unigram", "adaptive"])
def test_the_softmax_from_the_config_equals_the_one_swapped_in_after_the_build(model, softmax):
    """build_model builds the configured softmax itself; from the same seed the model has the same layer, the
    same weights, and gives the same losses, distributions and FLOP count as when a caller swapped it in."""
    from moe_scale.models.build import build_model

    V = 100
    counts = [1000 // (i + 1) for i in range(V)]
    config = RunConfig.from_settings(model=model, d_model=16, num_experts=4, top_k=2, expert_hidden=16,
                                     num_layers=1, ffn="moe", **softmax) if model == "transformer" else \
        RunConfig.from_settings(model=model, d_model=16, num_experts=4, top_k=2, expert_hidden=16, **softmax)
    torch.manual_seed(3)
    built = build_model(config, V, counts=counts)
    torch.manual_seed(3)
    swapped = _swapped_in(config, V, counts)
    assert type(built.softmax) is type(swapped.softmax)
    assert built.state_dict().keys() == swapped.state_dict().keys()
    for key, value in built.state_dict().items():
        assert torch.equal(value, swapped.state_dict()[key]), key
    assert built.softmax.forward_macs_per_token() == swapped.softmax.forward_macs_per_token()
    inputs_BT = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))
    for mode in ("eval", "train"):
        outputs = []
        for lm in (built, swapped):
            lm.train(mode == "train")
            torch.manual_seed(5)   # dropout, gate noise and the sampled softmax's draws
            outputs.append(lm(inputs_BT[:, :-1], inputs_BT[:, 1:]).nll_sum)
        assert torch.equal(*outputs), mode
    assert torch.equal(built.eval().decode(inputs_BT)[0], swapped.eval().decode(inputs_BT)[0])
