"""`moe-scale export --format hf`: transformers loads the directory (AutoModelForCausalLM with remote code,
the word-level tokenizer), its logits equal moe_scale's on real text, and greedy `generate` picks the words
`moe-scale generate --greedy` picks; runs trained on real text (WikiText-2 sentences), LSTM-MoE (with each
--softmax) and a transformer with MoA attention and an MoE FFN. The directory itself: missing parents of --out
are created (and removed again when the export fails), every file gets the mode the umask gives a new file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from moe_scale.cli import main as cli_main
from moe_scale.errors import UserError
from tests.wikitext import wikitext_sentences
from tests.cli_runs import TINY, run_cli, run_train

MODELS = {
    "lstm-moe": [],
    "transformer-moa-moe": ["--model", "transformer", "--attention", "moa", "--moa-num-experts", "4",
                            "--moa-top-k", "2", "--ffn", "moe", "--num-layers", "2"],
    "lstm-moe-sampled-unigram": ["--softmax", "sampled", "--sampler", "unigram", "--num-sampled", "50"],
    "lstm-moe-adaptive": ["--softmax", "adaptive", "--adaptive-cutoffs", "50,200"],
    "lstm-aux-free-shared": ["--gate", "aux_free", "--bias-update-rate", "0.01", "--shared-experts", "1",
                             "--shared-expert-gate"],   # the routing biases (a buffer) travel in model.safetensors
}


@pytest.mark.parametrize("name", MODELS)
def test_exported_model_loads_in_transformers_and_matches(tmp_path, embedded_cache, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = tmp_path / "train.txt"
    corpus.write_text("\n".join(wikitext_sentences("valid")[:800]) + "\n", encoding="utf-8")
    run, out = tmp_path / "run", tmp_path / "hf"
    run_train([*TINY, *MODELS[name], "--data", str(corpus), "--vocab-size", "400", "--max-steps", "6",
               "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
    run_cli("export", "--run", str(run), "--format", "hf", "--out", str(out), cwd=tmp_path, cache=embedded_cache,
            check=True)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                               "modeling_moe_scale.py", "configuration_moe_scale.py"}
    model = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)

    from moe_scale.inference.trained_run import open_trained_run
    environment = dict(os.environ)   # the in-process load sets RANK, MASTER_PORT, ...: keep them from the CLI
    try:
        trained = open_trained_run(run, None, "test")
        vocab, ours = trained.tokenizer, trained.model
    finally:
        os.environ.clear()
        os.environ.update(environment)
    exported_softmax = "AdaptiveSoftmax" if "adaptive" in name else "FullSoftmax"   # sampled: the full one at eval
    assert type(model.lm.softmax).__name__ == exported_softmax
    text = " ".join(wikitext_sentences("test")[0].split()[:14])
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == [vocab.BOS_ID, *vocab.encode(text)]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ours.decode(ids)[0], atol=1e-5, rtol=1e-5)

    prompt = " ".join(text.split()[:3])
    generated = model.generate(tokenizer(prompt, return_tensors="pt").input_ids, do_sample=False,
                               max_new_tokens=6)[0, 4:]
    words = [w if w != "<UNK>" else "<unk>" for w in tokenizer.convert_ids_to_tokens(generated.tolist())]
    if words and words[-1] == "</S>":
        words = words[:-1]
    shown = run_cli("generate", "--run", str(run), "--prompt", prompt, "--greedy", "--max-new-tokens", "6",
                 cwd=tmp_path, cache=embedded_cache, check=True).stdout.split()
    assert [w for w in shown[3:] if w != "..."] == words
    assert shown[:3] == [w if vocab.id(w) != vocab.UNK_ID else "<unk>" for w in prompt.split()]
    assert len(words) == 6 or generated[len(words)] == vocab.EOS_ID   # six words, or the sentence ended


def export_under_umask_027(argv: list[str]) -> int:
    """`moe-scale ARGS` in a shell whose umask is 027 (group: no write; others: nothing)."""
    os.umask(0o027)
    return cli_main(argv)


def test_export_creates_missing_parents_and_gives_every_file_the_umasks_mode(tmp_path, lstm_run, embedded_cache):
    out = tmp_path / "exported" / "deeper" / "lstm-moe"
    run_cli("export", "--run", str(lstm_run), "--out", str(out), cwd=tmp_path, cache=embedded_cache, check=True,
            entry=export_under_umask_027)
    files = sorted(p for p in out.iterdir())
    assert "model.safetensors" in [p.name for p in files] and all(p.is_file() for p in files)
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == {p.name: 0o640 for p in files}
    for directory in (out, out.parent, out.parent.parent):
        assert directory.stat().st_mode & 0o777 == 0o750, directory


def test_a_failed_export_removes_the_parents_it_created(tmp_path, lstm_run, monkeypatch):
    from moe_scale.inference import hf_export

    def disk_full(target: Path, *args) -> None:
        (target / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "_write", disk_full)
    (tmp_path / "exported").mkdir()
    environment = dict(os.environ)   # the in-process load sets RANK, MASTER_PORT, ...: keep them from the CLI
    try:
        with pytest.raises(UserError, match="No space left on device.*nothing was left behind"):
            hf_export.export_hf(lstm_run, tmp_path / "exported" / "a" / "b" / "hf", None)
    finally:
        os.environ.clear()
        os.environ.update(environment)
    assert list((tmp_path / "exported").iterdir()) == []


def test_an_export_removes_what_a_killed_export_of_the_same_directory_left(tmp_path, lstm_run, monkeypatch):
    """A `.NAME.partial-PID` whose process is gone (kill -9 mid-export) is removed by the next export of NAME; a
    live process's is left alone."""
    from moe_scale.inference import hf_export

    monkeypatch.setattr(hf_export, "_write", lambda target, *args: (target / "config.json").write_text("{}"))
    stale, live = tmp_path / ".hf.partial-999999999", tmp_path / f".hf.partial-{os.getppid()}"
    for partial in (stale, live):
        partial.mkdir()
        (partial / "config.json").write_text("{}")
    environment = dict(os.environ)
    try:
        hf_export.export_hf(lstm_run, tmp_path / "hf", None)
    finally:
        os.environ.clear()
        os.environ.update(environment)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", live.name])
