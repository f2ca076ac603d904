"""Generation: with its cache, greedy generation picks the same words as re-running the whole sequence every
step, and --show-experts reports the routing the full forward gives each word; the command on real runs (LSTM,
and a transformer with MoA and an MoE FFN trained on 2 processes with --ep-size 2) prints only the samples, and
says so when a sample ends its sentence before any new word."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from moe_scale.data import Vocab
from moe_scale.inference.generate import RouteRecorder, Sample, ended_at_once, generate
from moe_scale.inference.sampling import SamplingConfig
from tests.models.test_decode import MODELS, V, _model
from tests.cli_runs import TINY, run_cli, run_train
from tests.paths import DS_CONFIGS

PROMPT = [5, 9, 3]


def _vocab() -> Vocab:
    return Vocab([*Vocab.SPECIALS, *(f"w{i}" for i in range(3, V))])


@pytest.mark.parametrize("name", ["lstm-moe-lstm", "moa-moe", "mae-dense"])
def test_cached_greedy_generation_equals_rerunning_the_sequence(name):
    model, vocab = _model(MODELS[name]), _vocab()
    samples = generate(model, vocab, PROMPT, 2, 6, SamplingConfig(greedy=True), torch.Generator(), torch.device("cpu"),
                       show_experts=True)
    sequence = torch.tensor([[Vocab.BOS_ID, *PROMPT]])
    recorder = RouteRecorder(model)
    for step in range(6):
        log_probs, _ = model.decode(sequence)
        word = int(log_probs[0, -1].argmax())
        if word == Vocab.EOS_ID:
            assert samples[0].finished and len(samples[0].words) == step
            break
        assert samples[0].words[step] == (vocab.words[word] if word else "<unk>")
        sequence = torch.cat([sequence, torch.tensor([[word]])], dim=1)
        model.decode(sequence)   # the word's routing as an input, from the full forward
        full = recorder.of_token(sequence.shape[1] - 1)
        for layer, pairs in samples[0].routes[step].items():
            assert [e for e, _ in pairs] == [e for e, _ in full[layer]]
            torch.testing.assert_close(torch.tensor([g for _, g in pairs]), torch.tensor([g for _, g in full[layer]]))
    recorder.close()
    assert samples[1].words == samples[0].words   # greedy: every sample the same


def _generate(run: Path, *args: str, cache: Path) -> subprocess.CompletedProcess:
    return run_cli("generate", "--run", str(run), *args, cwd=run.parent, cache=cache, check=True)


def test_generate_from_an_lstm_run(lstm_run, embedded_cache):
    run = lstm_run
    first = _generate(run, "--greedy", "--max-new-tokens", "5", cache=embedded_cache).stdout
    assert first == _generate(run, "--greedy", "--max-new-tokens", "5", cache=embedded_cache).stdout
    assert len(first.split()) <= 6 and "DeepSpeed" not in first   # only the sample on stdout
    a, b = (_generate(run, "--seed", s, "--num-samples", "3", "--prompt", "the zzunknownzz", cache=embedded_cache)
            .stdout.splitlines() for s in ("1", "2"))
    assert len(a) == 3 and all(line.startswith(f"[{i + 1}] the <unk>") for i, line in enumerate(a)) and a != b


@pytest.mark.slow
@pytest.mark.multiprocess
def test_generate_from_a_two_process_expert_parallel_transformer(tmp_path, embedded_cache):
    run = tmp_path / "run"
    run_train([*TINY, "--model", "transformer", "--attention", "moa", "--moa-num-experts", "4", "--moa-top-k", "2",
               "--ffn", "moe", "--num-layers", "2", "--max-steps", "4", "--ep-size", "2", "--ds-config",
               str(DS_CONFIGS / "zero2_ep.json"), "--out", str(run)],
              cwd=tmp_path, cache=embedded_cache, nprocs=2)
    out = _generate(run, "--show-experts", "--max-new-tokens", "4", "--top-k", "20", cache=embedded_cache).stdout
    lines = out.splitlines()
    assert lines[0].startswith("[1] ") and lines[1].split()[:2] == ["word", "blocks.0.attn"]
    assert "blocks.1.ffn" in lines[1]
    for row in lines[2:]:   # per word: 2 attention experts and 2 FFN experts in each of 2 blocks
        assert row.count(" e") == 8, row

    # exported with the experts of both expert-parallel ranks, transformers generates the same words
    from transformers import AutoModelForCausalLM
    run_cli("export", "--run", str(run), "--out", str(tmp_path / "hf"), cwd=tmp_path, cache=embedded_cache, check=True)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    ids = model.generate(torch.tensor([[Vocab.BOS_ID]]), do_sample=False, max_new_tokens=5)[0, 1:].tolist()
    vocab = Vocab.load(run / "vocab")
    words = [vocab.words[i] if i else "<unk>" for i in ids if i != Vocab.EOS_ID]
    greedy = _generate(run, "--greedy", "--max-new-tokens", "5", cache=embedded_cache).stdout.split()
    assert [w for w in greedy if w != "..."] == words


class _EndsAtOnce(torch.nn.Module):
    """A model whose every next token is </S>: the decode of `inner` with all probability on </S>."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def decode(self, inputs_BT, state=None):
        log_probs_BTV, state = self.inner.decode(inputs_BT, state)
        only_eos = torch.full_like(log_probs_BTV, float("-inf"))
        only_eos[..., Vocab.EOS_ID] = 0.0
        return only_eos, state


def test_a_sample_that_ends_at_once_is_finished_and_empty_and_said_so():
    model = _EndsAtOnce(_model(MODELS["lstm-moe-lstm"]))
    samples = generate(model, _vocab(), PROMPT, 2, 6, SamplingConfig(greedy=True), torch.Generator(),
                       torch.device("cpu"))
    assert [(s.finished, s.words, s.ids) for s in samples] == [(True, [], [])] * 2
    assert ended_at_once(samples[:1], greedy=True) == (
        "the model ended the sentence at once: the most likely token after the prompt is </S>, the end of a "
        "sentence, so nothing new was generated; drop --greedy to sample, or give a longer prompt")
    mixed = [Sample([], finished=True), Sample(["a"], [7], finished=True), Sample([], finished=True),
             Sample([], finished=False)]   # the last one stopped at the token limit
    assert ended_at_once(mixed, greedy=False) == (
        "samples 1 and 3 of 4 ended the sentence at once: </S>, the end of a sentence, was drawn right after the "
        "prompt, so nothing new was generated; try another --seed or a longer prompt")
    assert ended_at_once(mixed[:2], greedy=False).startswith("sample 1 of 2 ended the sentence at once: ")
    assert ended_at_once(mixed[1:2], greedy=False) is None and ended_at_once(mixed[3:], greedy=True) is None


def _generate_ending_at_once(argv: list[str]) -> int:
    """`moe-scale ARGV` where every token drawn is </S> (forked as a command: tests/forked.py)."""
    from moe_scale.cli import main
    from moe_scale.inference import generate as generation

    generation.next_words = lambda log_probs_BV, sampling, generator: torch.full(
        (log_probs_BV.shape[0],), Vocab.EOS_ID, dtype=torch.long)
    return main(argv)


def test_generate_says_when_the_model_ends_the_sentence_at_once(lstm_run, embedded_cache):
    proc = run_cli("generate", "--run", str(lstm_run), "--prompt", "ROMEO:", "--greedy", cwd=lstm_run.parent,
                   cache=embedded_cache, entry=_generate_ending_at_once, check=True)
    assert proc.stdout == "<unk>\n"   # the prompt (a word the run never saw), and nothing after it
    assert proc.stderr.splitlines() == [
        "moe-scale: the model ended the sentence at once: the most likely token after the prompt is </S>, the end "
        "of a sentence, so nothing new was generated; drop --greedy to sample, or give a longer prompt"]
