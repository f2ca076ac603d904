"""`moe-scale export --format hf` of a --block llama run (issue 44): a native MixtralForCausalLM directory (with
shared experts: Qwen2MoeForCausalLM; with --qk-norm: Qwen3MoeForCausalLM (Qwen3ForCausalLM with a dense FFN:
tests/commands/test_model_kinds.py); past --max-shard-size in shards with an index), no remote code, that plain
`AutoModelForCausalLM.from_pretrained(DIR)` loads; its logits are moe_scale's (float32, relative error ≤ 1e-4)
and greedy `generate` gives the text `moe-scale generate --greedy` prints; `train --init-from-hf DIR` imports it
(round trip: import, then export, gives the same tensors and the same validation perplexity), and refuses in one
line, with nothing written, a run of another shape or another vocabulary."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.cli_runs import TINY, assert_one_line_error, run_cli, run_train
from tests.wikitext import wikitext_sentences

LLAMA = ["--model", "transformer", "--block", "llama", "--ffn", "moe", "--num-layers", "2", "--num-heads", "4",
         "--vocab-size", "400"]


QWEN = [*LLAMA, "--shared-experts", "2", "--shared-expert-hidden", "16", "--shared-expert-gate"]
QWEN3 = [*LLAMA, "--qk-norm", "--rms-norm-eps", "1e-6"]   # Qwen3-MoE: q/k norms, no shared expert
KINDS = {"MixtralForCausalLM": ("exported", LLAMA), "Qwen2MoeForCausalLM": ("exported_qwen", QWEN),
         "Qwen3MoeForCausalLM": ("exported_qwen3", QWEN3)}


def _export(root, flags, embedded_cache):
    corpus = root / "train.txt"
    corpus.write_text("\n".join(wikitext_sentences("valid")[:800]) + "\n", encoding="utf-8")
    run, out = root / "run", root / "hf"
    run_train([*TINY, *flags, "--data", str(corpus), "--max-steps", "6", "--out", str(run)], cwd=root,
              cache=embedded_cache)
    proc = run_cli("export", "--run", str(run), "--format", "hf", "--out", str(out), cwd=root, cache=embedded_cache,
                   check=True)
    assert f"from_pretrained({str(out)!r})" in proc.stdout   # no trust_remote_code to pass
    return corpus, run, out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, embedded_cache):
    """(corpus, run, export) of a tiny Mixtral-style run trained 6 steps on WikiText-2 sentences."""
    return _export(tmp_path_factory.mktemp("native"), LLAMA, embedded_cache)


@pytest.fixture(scope="module")
def exported_qwen(tmp_path_factory, embedded_cache):
    """The same with 2 gated shared experts of width 16: Qwen2-MoE's architecture."""
    return _export(tmp_path_factory.mktemp("qwen"), QWEN, embedded_cache)


@pytest.fixture(scope="module")
def exported_qwen3(tmp_path_factory, embedded_cache):
    """With Qwen3's q/k norms and its 1e-6 epsilon: Qwen3-MoE's architecture."""
    return _export(tmp_path_factory.mktemp("qwen3"), QWEN3, embedded_cache)


def _open(run):
    from moe_scale.inference.trained_run import open_trained_run

    environment = dict(os.environ)   # the in-process load sets RANK, MASTER_PORT, ...: keep them from the CLI
    try:
        return open_trained_run(run, None, "test")
    finally:
        os.environ.clear()
        os.environ.update(environment)


@pytest.mark.parametrize("arch", KINDS)
def test_transformers_loads_it_without_remote_code_with_the_same_logits_and_greedy_text(arch, request,
                                                                                        embedded_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run, out = request.getfixturevalue(KINDS[arch][0])
    assert not list(out.glob("*.py"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch] and "auto_map" not in config
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert type(model).__name__ == arch
    ours = _open(run)
    text = " ".join(wikitext_sentences("test")[0].split()[:14])
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == [ours.tokenizer.BOS_ID, *ours.tokenizer.encode(text)]
    with torch.no_grad():
        logits = model(ids).logits
        softmax = ours.model.softmax
        hidden = {}
        handle = ours.model.final_norm.register_forward_hook(lambda m, i, o: hidden.setdefault("h", o))
        log_probs = ours.model.decode(ids)[0]
        handle.remove()
        mine = softmax.proj(hidden["h"])
    assert logits.dtype == mine.dtype == torch.float32
    assert ((logits - mine).abs().max() / mine.abs().max()).item() <= 1e-4
    torch.testing.assert_close(logits.log_softmax(-1), log_probs, rtol=1e-4, atol=1e-5)

    prompt = " ".join(text.split()[:3])
    prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
    generated = model.generate(prompt_ids, do_sample=False, max_new_tokens=6)[0, prompt_ids.shape[1]:].tolist()
    if ours.tokenizer.EOS_ID in generated:
        generated = generated[:generated.index(ours.tokenizer.EOS_ID)]
    shown = run_cli("generate", "--run", str(run), "--prompt", prompt, "--greedy", "--max-new-tokens", "6",
                    cwd=run.parent, cache=embedded_cache, check=True).stdout
    from moe_scale.inference.generate import render

    ended = len(generated) < 6
    assert shown == render(ours.tokenizer, [*ours.tokenizer.encode(prompt), *generated]) + \
        ("" if ended else " ...") + "\n"


def test_it_accepts_positions_past_the_trained_context_and_its_config_says_so(exported):
    """Rotary positions have no table: config.json's max_position_embeddings and the tokenizer's model_max_length
    are 2^24 (every float32 position index exact: moe_scale/weights/hf_native.py), not the trained --seq-len 16,
    and 40 positions give moe_scale's own logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_scale.weights.hf_native import ROTARY_MAX_POSITIONS

    _, run, out = exported
    assert ROTARY_MAX_POSITIONS == 2 ** 24
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 2 ** 24
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 2 ** 24
    assert json.loads((out / "config.json").read_text())["run_config"]["data"]["seq_len"] == 16
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 2 ** 24
    text = " ".join(" ".join(wikitext_sentences("test")[:8]).split()[:39])
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.shape[1] == 40
    ours = _open(run)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.log_softmax(-1), ours.model.decode(ids)[0], rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("arch", [arch for arch in KINDS if arch != "Qwen3MoeForCausalLM"])   # (Qwen3-MoE's: from
def test_init_from_hf_then_export_gives_the_same_tensors(arch, request, embedded_cache, tmp_path):   # its shards)
    """--lr 0: the imported weights go through one optimizer step unchanged, so the round trip is exact."""
    from safetensors.torch import load_file

    corpus, run, out = request.getfixturevalue(KINDS[arch][0])
    again = tmp_path / "again"
    run_train([*TINY, *KINDS[arch][1], "--data", str(corpus), "--max-steps", "1", "--lr", "0", "--init-from-hf",
               str(out), "--out", str(again)], cwd=tmp_path, cache=embedded_cache)
    run_cli("export", "--run", str(again), "--out", str(tmp_path / "hf"), cwd=tmp_path, cache=embedded_cache,
            check=True)
    first, second = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name
    summaries = [json.loads((r / "summary.json").read_text()) for r in (run, again)]
    assert summaries[1]["valid_ppl"] == pytest.approx(summaries[0]["valid_ppl"], rel=1e-6)


@pytest.mark.parametrize("flags, fragments", [
    (["--d-model", "48"], ("hidden_size is 32, this run's 48", "--d-model")),
    (["--num-experts", "4"], ("num_local_experts is 8, this run's 4", "--num-experts")),
    (["--tie-embeddings"], ("tie_word_embeddings is False, this run's True", "--tie-embeddings")),
    (["--shuffled-corpus"], ("vocabulary", "first difference at id", "--tokenizer")),
], ids=["width", "experts", "tied", "vocabulary"])
def test_a_run_of_another_shape_or_vocabulary_is_refused(exported, embedded_cache, tmp_path, flags, fragments):
    corpus, _, out = exported
    if flags == ["--shuffled-corpus"]:   # the same size of vocabulary, other words at its ids
        other = tmp_path / "other.txt"
        other.write_text("\n".join(wikitext_sentences("test")[:800]) + "\n", encoding="utf-8")
        corpus, flags = other, []
    proc = run_cli("train", *TINY, *LLAMA, "--data", str(corpus), "--max-steps", "1", *flags,
                   "--init-from-hf", str(out), "--out", str(tmp_path / "run"), cwd=tmp_path, cache=embedded_cache)
    assert_one_line_error(proc, f"--init-from-hf {out}", *fragments)
    assert not (tmp_path / "run").exists()


def test_past_max_shard_size_it_writes_shards_and_an_index_that_load_and_import(exported_qwen3, embedded_cache,
                                                                              tmp_path):
    """--max-shard-size 40KB: several safetensors files and model.safetensors.index.json, as save_pretrained writes
    them; transformers loads the same model as from the single file, --init-from-hf imports it, and a cut-short or
    missing shard is refused in one line."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    corpus, run, single = exported_qwen3
    sharded = tmp_path / "sharded"
    run_cli("export", "--run", str(run), "--max-shard-size", "40KB", "--out", str(sharded), cwd=tmp_path,
            cache=embedded_cache, check=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (sharded / "model.safetensors").exists()
    assert files == sorted(p.name for p in sharded.glob("model-*-of-*.safetensors"))
    whole = load_file(str(single / "model.safetensors"))
    parts = {name: t for file in files for name, t in load_file(str(sharded / file)).items()}
    assert parts.keys() == whole.keys() == index["weight_map"].keys()
    assert all(torch.equal(parts[name], whole[name]) for name in whole)
    assert all((sharded / file).stat().st_size <= 40_000 + 4096 or len(load_file(str(sharded / file))) == 1
               for file in files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(str(sharded))(ids).logits,
                                   AutoModelForCausalLM.from_pretrained(str(single))(ids).logits, rtol=0, atol=0)
    again = tmp_path / "again"
    run_train([*TINY, *QWEN3, "--data", str(corpus), "--max-steps", "1", "--lr", "0", "--init-from-hf",
               str(sharded), "--out", str(again)], cwd=tmp_path, cache=embedded_cache)
    run_cli("export", "--run", str(again), "--out", str(tmp_path / "hf"), cwd=tmp_path, cache=embedded_cache,
            check=True)
    again_tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert again_tensors.keys() == whole.keys() and all(torch.equal(again_tensors[n], whole[n]) for n in whole)

    shard = max((sharded / file for file in files), key=lambda path: path.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])   # cut short
    proc = run_cli("train", *TINY, *QWEN3, "--data", str(corpus), "--max-steps", "1", "--init-from-hf",
                   str(sharded), "--out", str(tmp_path / "cut"), cwd=tmp_path, cache=embedded_cache)
    assert_one_line_error(proc, f"{shard.name} is not a readable safetensors file")
    shard.unlink()
    proc = run_cli("train", *TINY, *QWEN3, "--data", str(corpus), "--max-steps", "1", "--init-from-hf",
                   str(sharded), "--out", str(tmp_path / "missing"), cwd=tmp_path, cache=embedded_cache)
    assert_one_line_error(proc, f"names the shard {shard.name}, which is not there")
    assert not (tmp_path / "cut").exists() and not (tmp_path / "missing").exists()
    assert_one_line_error(run_cli("export", "--run", str(run), "--max-shard-size", "lots", "--out",
                                  str(tmp_path / "x"), cwd=tmp_path), "--max-shard-size lots")
