"""Next-word choice: greedy is the argmax; top-k and top-p keep exactly the words they name (by hand);
draws follow the filtered, temperature-scaled distribution (Monte-Carlo)."""

import pytest
import torch

from moe_scale.errors import UserError
from moe_scale.inference.sampling import SamplingConfig, filtered_logits, next_words

PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3]])


def kept(config: SamplingConfig) -> list[int]:
    return torch.isfinite(filtered_logits(PROBS.log(), config))[0].nonzero()[:, 0].tolist()


@pytest.mark.parametrize("top_k, top_p, want", [
    (0, 1.0, [0, 1, 2, 3]), (1, 1.0, [1]), (2, 1.0, [1, 3]), (4, 1.0, [0, 1, 2, 3]),
    (0, 0.5, [1]), (0, 0.79, [1, 3]), (0, 0.8, [1, 3]), (0, 0.81, [1, 2, 3]), (0, 0.96, [0, 1, 2, 3]),
    (0, 1e-9, [1]), (2, 0.9, [1, 3]),
])
def test_top_k_and_top_p_keep_exactly_the_words_they_name(top_k, top_p, want):
    assert kept(SamplingConfig(top_k=top_k, top_p=top_p)) == want


def test_greedy_is_the_argmax_and_draws_follow_the_filtered_distribution():
    generator = torch.Generator().manual_seed(0)
    assert next_words(PROBS.log(), SamplingConfig(greedy=True), generator).tolist() == [1]
    n = 40_000
    log_probs = PROBS.log().expand(n, 4)
    for config, want in [(SamplingConfig(), PROBS[0]),
                         (SamplingConfig(top_k=2), torch.tensor([0, 0.5, 0, 0.3]) / 0.8),
                         (SamplingConfig(temperature=0.5), PROBS[0] ** 2 / (PROBS[0] ** 2).sum())]:
        freq = torch.bincount(next_words(log_probs, config, generator), minlength=4).float() / n
        torch.testing.assert_close(freq, want, atol=0.01, rtol=0)   # 4 sigma at n = 40k is under 0.01


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_tiny_temperature_draws_the_most_likely_word(temperature):
    """No overflow to inf - inf: the best word's logit is 0 before dividing, the others go to -inf."""
    generator = torch.Generator().manual_seed(0)
    log_probs = torch.cat([PROBS.log(), PROBS.flip(-1).log()])
    for config in (SamplingConfig(temperature=temperature), SamplingConfig(temperature=temperature, top_p=0.5),
                   SamplingConfig(temperature=temperature, top_k=2)):
        assert next_words(log_probs, config, generator).tolist() == [1, 2]


@pytest.mark.parametrize("config, words", [
    (SamplingConfig(temperature=0), "--temperature must be positive"),
    (SamplingConfig(temperature=-1), "--greedy"),
    (SamplingConfig(top_p=0), "--top-p must lie in (0, 1]"),
    (SamplingConfig(top_p=1.5), "--top-p must lie in (0, 1]"),
    (SamplingConfig(top_k=-1), "--top-k must be 0"),
])
def test_bad_settings_are_one_line(config, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace("]", r"\]")):
        config.validate()
    SamplingConfig(temperature=0, greedy=True).validate()   # greedy needs no temperature
