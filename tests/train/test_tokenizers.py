"""Raw text in (issue: punctuation glued to words): `--tokenizer bpe` learns a byte-level BPE, saved in the run,
reused on resume and by `--tokenizer PATH`; eval's perplexity stays per word; generate and the HF export use
the run's tokenizer. The text is WikiText-2 with its tokenisation undone (tests/fixtures, CC BY-SA 3.0)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from moe_scale.data.eval_windows import EvalWindows
from moe_scale.data.vocab import Vocab
from tests.wikitext import wikitext_sentences
from tests.cli_runs import TINY, run_cli, run_eval, run_train, step_log

_GLUE = [(r" @(.)@ ", r"\1"), (r" ([,.;:!?)])", r"\1"), (r"\( ", "("), (r" ('s|'re|n't)\b", r"\1")]


def raw(sentence: str) -> str:
    """WikiText's tokenised sentence as raw text: 'in 1 @,@ 000 years , it 's' -> 'in 1,000 years, it's'."""
    for pattern, replacement in _GLUE:
        sentence = re.sub(pattern, replacement, sentence)
    return sentence


@pytest.fixture(scope="module")
def raw_text(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("raw")
    valid, test = wikitext_sentences("valid"), wikitext_sentences("test")
    for name, sentences in (("train.txt", valid[:1500]), ("valid.txt", valid[1500:1700]), ("test.txt", test[:200])):
        (root / name).write_text("\n".join(raw(s) for s in sentences) + "\n", encoding="utf-8")
    return root


def test_words_leave_raw_text_full_of_unknowns(raw_text):
    """The problem the BPE solves: at the same vocabulary size a word vocabulary of raw text maps a large share
    of held-out words to <UNK> ('years,' and 'years' are different words)."""
    train = (raw_text / "train.txt").read_text().splitlines()
    test = (raw_text / "test.txt").read_text().splitlines()
    counts = EvalWindows(test, Vocab.build(train, max_size=600), 16, 4).counts
    assert counts["oov_words"] / counts["words"] > 0.25
    assert any("," in w for s in test for w in s.split())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bpe_run_end_to_end(tmp_path, raw_text, embedded_cache):
    run = tmp_path / "bpe"
    common = [*TINY, "--data", str(raw_text), "--vocab-size", "600", "--eval-interval", "6"]
    run_train([*common, "--tokenizer", "bpe", "--max-steps", "6", "--checkpoint-interval", "6", "--out", str(run)],
              cwd=tmp_path, cache=embedded_cache)
    assert (run / "tokenizer.json").is_file() and not (run / "vocab").exists()
    saved = (run / "tokenizer.json").read_bytes()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tokenizer"] == "bpe" and summary["tokens_per_word"] > 1.2
    assert math.isfinite(summary["valid_ppl"]) and summary["unigram_valid_ppl"] > 1

    # eval on the test text: per word, nothing unknown
    result = run_eval(["--run", str(run), "--split", "test"], cwd=tmp_path, cache=embedded_cache)
    assert result["tokenizer"] == "bpe" and result["oov_words"] == 0
    assert result["words_predicted"] == result["words"] + result["sentences"] < result["tokens"]
    per_word = math.exp(result["nll_per_token"] * result["tokens"] / result["words_predicted"])
    assert result["ppl"] == pytest.approx(per_word, rel=1e-9)

    # resume: the saved tokenizer, even with the flag pointing elsewhere now
    run_train(["--resume", "--max-steps", "8", "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
    assert (run / "tokenizer.json").read_bytes() == saved

    # --tokenizer PATH: a new run with this run's tokenizer.json (copied, so the original can go)
    copy = tmp_path / "bpe-tokenizer.json"
    copy.write_bytes(saved)
    other = tmp_path / "reuse"
    reuse = [*common, "--tokenizer", str(copy), "--max-steps", "2", "--noise-rng", "global", "--dropout", "0"]
    run_train([*reuse, "--out", str(other)], cwd=tmp_path, cache=embedded_cache)
    assert (other / "tokenizer.json").read_bytes() == saved
    assert json.loads((other / "summary.json").read_text())["tokenizer"] == "file"

    # subword ids split over 2 processes by rows (--vocab-exchange rows, the default) as word ids are: the same
    # steps (the full softmax: in training each process draws its own samples for the sampled one)
    two = tmp_path / "two"
    run_train([*reuse, "--ep-size", "2", "--out", str(two)], cwd=tmp_path, cache=embedded_cache, nprocs=2)
    for a, b in zip(step_log(other), step_log(two), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5), (a, b)
    layout = json.loads((two / "checkpoints" / "step00000002" / "layout.json").read_text())
    assert layout["vocab_rows"] == ["embedding.weight", "softmax.proj.bias", "softmax.proj.weight"]

    # generate and the HF export: the same greedy text, the same logits
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = raw(wikitext_sentences("test")[3]).split()[:4]
    ours = run_cli("generate", "--run", str(run), "--prompt", " ".join(prompt), "--greedy", "--max-new-tokens", "8",
                cwd=tmp_path, cache=embedded_cache, check=True).stdout.strip()
    assert ours.startswith(" ".join(prompt))
    out = tmp_path / "hf"
    run_cli("export", "--run", str(run), "--format", "hf", "--out", str(out), cwd=tmp_path, cache=embedded_cache,
            check=True)
    model = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    ids = tokenizer(" ".join(prompt), return_tensors="pt").input_ids
    from moe_scale.data.subwords import SubwordTokenizer
    bpe = SubwordTokenizer.load(run / "tokenizer.json")
    assert ids[0].tolist() == [Vocab.BOS_ID, *bpe.encode(" ".join(prompt))]
    generated = model.generate(ids, do_sample=False, max_new_tokens=8)[0, ids.shape[1]:].tolist()
    if Vocab.EOS_ID in generated:
        generated = generated[:generated.index(Vocab.EOS_ID)]
    assert ours.removesuffix(" ...") == bpe.decode(bpe.encode(" ".join(prompt)) + generated)

    from moe_scale.inference.trained_run import open_trained_run
    environment = dict(os.environ)
    try:
        lm = open_trained_run(run, None, "test").model
    finally:
        os.environ.clear()
        os.environ.update(environment)
    text = tokenizer(raw(wikitext_sentences("test")[7]), return_tensors="pt").input_ids[:, :16]
    with torch.no_grad():
        torch.testing.assert_close(model(text).logits, lm.decode(text)[0], atol=1e-5, rtol=1e-5)

