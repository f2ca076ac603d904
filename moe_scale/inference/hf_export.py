"""A trained run as a HuggingFace model directory: `AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True)` and `AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)` load it (moe_scale must
be installed there; transformers 5's AutoTokenizer reads config.json, whose model type is remote code, so without
trust_remote_code=True it asks [y/N]). A --block llama run is written as transformers' own MixtralForCausalLM or
LlamaForCausalLM instead (weights/hf_native.py: no remote code, no moe_scale needed to load it; same tokenizer
files, config.json with the run's configuration under `run_config`).

    config.json                 transformers' config: model_type moe_scale, auto_map, the run's configuration
    configuration_moe_scale.py  modeling_moe_scale.py   the remote code (hf_remote/)
    model.safetensors           every weight, the experts of every expert-parallel rank gathered (past
                                --max-shard-size: model-0000i-of-0000n.safetensors and model.safetensors.index.json)
    tokenizer.json              the run's tokenizer (word-level over its vocabulary, or its BPE), <S> prepended
    tokenizer_config.json  special_tokens_map.json  README.md

Written under a temporary name beside --out and renamed when complete, every file with the permissions a new
file gets (0666 less the umask); an existing --out is refused, missing parent directories are created (and
removed again if the export fails).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from moe_scale.errors import UserError
from moe_scale.files import new_file_mode, process_alive

REMOTE = Path(__file__).with_name("hf_remote")
REMOTE_FILES = ("configuration_moe_scale.py", "modeling_moe_scale.py")
CARD_PROMPT = "the company said"   # what the README's example continues
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9   # transformers' save_pretrained's 5GB (4.x)
INDEX = "model.safetensors.index.json"


def check_target(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise UserError(f"--out {out} already exists; export writes a new directory: choose another --out or "
                        f"remove it")
    existing = out.parent
    while not (existing.exists() or existing.is_symlink()):
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"--out {out}: {existing} is not a directory; choose an --out inside a directory")


def export_hf(run: Path, out: Path, checkpoint: str | None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Writes the model directory (and its missing parents); returns the checkpoint tag exported."""
    from moe_scale.inference.trained_run import open_trained_run

    check_target(out)
    trained = open_trained_run(run, checkpoint, "export")
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    created: list[Path] = []
    try:
        _make_parents(out.parent, created)
        _remove_stale_partials(out)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        _write(partial, trained.config, trained.tokenizer, trained.model, run, trained.checkpoint, max_shard_bytes)
        partial.rename(out)
    except OSError as e:
        _remove(partial, created)
        raise UserError(f"writing {out} failed ({e.strerror or e}); nothing was left behind") from None
    except BaseException:
        _remove(partial, created)
        raise
    return trained.checkpoint


def _remove_stale_partials(out: Path) -> None:
    """What an export of `out` killed half-way left (a `.NAME.partial-PID` whose process is gone)."""
    for stale in out.parent.glob(f".{out.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _make_parents(directory: Path, created: list[Path]) -> None:
    """Creates the missing directories down to `directory`, recording each in `created` as it is made."""
    missing = []
    while not (directory.exists() or directory.is_symlink()):
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        path.mkdir()
        created.append(path)


def _remove(partial: Path, created: list[Path]) -> None:
    """A failed export leaves nothing: its partial directory, then the parents it created, innermost first."""
    shutil.rmtree(partial, ignore_errors=True)
    for path in reversed(created):
        try:
            path.rmdir()
        except OSError:
            pass


def shards(tensors: dict, max_shard_bytes: int) -> list[list[str]]:
    """The tensors' names cut into files of at most `max_shard_bytes` each, in order (a tensor larger than the
    limit has a file of its own), as transformers' save_pretrained shards."""
    out, size = [[]], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > max_shard_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return out


def _save_tensors(target: Path, tensors: dict, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """model.safetensors, or past `max_shard_bytes` the shards model-0000i-of-0000n.safetensors and their
    index (model.safetensors.index.json: the total size and each tensor's file), as save_pretrained writes them."""
    from safetensors.torch import save_file

    parts = shards(tensors, max_shard_bytes)
    names = ["model.safetensors"] if len(parts) == 1 else \
        [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for file, part in zip(names, parts):
        save_file({name: tensors[name] for name in part}, str(target / file), metadata={"format": "pt"})
        os.chmod(target / file, new_file_mode())   # save_file writes it owner-only
    if len(parts) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (target / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                "weight_map": {name: file for file, part in zip(names, parts)
                                                               for name in part}}, indent=2) + "\n")


def _write(target: Path, config, vocab, model, run: Path, tag: str, max_shard_bytes: int) -> None:
    from moe_scale.weights import hf_native

    provenance = {"run_config": config.to_dict(), "exported_from": {"run": str(run.resolve()), "checkpoint": tag}}
    if hf_native.is_native(config):   # transformers' own Mixtral / Llama: no remote code
        _save_tensors(target, hf_native.export_tensors(model, config), max_shard_bytes)
        hf_config = {**hf_native.hf_config(config, len(vocab), vocab.BOS_ID, vocab.EOS_ID), **provenance}
        (target / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        _write_tokenizer(target, vocab, hf_native.ROTARY_MAX_POSITIONS)   # rotary: no position table
        (target / "README.md").write_text(_model_card(config, vocab, tag, hf_config["architectures"][0]))
        return
    state = {f"lm.{name}": t.detach().cpu().clone().contiguous() for name, t in _tensors_by_module_path(model)}
    _save_tensors(target, state, max_shard_bytes)
    context = config.data.seq_len if config.model.kind == "transformer" else 0
    hf_config = {
        "model_type": "moe_scale", "architectures": ["MoEScaleForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_moe_scale.MoEScaleConfig",
                     "AutoModelForCausalLM": "modeling_moe_scale.MoEScaleForCausalLM"},
        "run_config": config.to_dict(), "vocab_size": len(vocab), "context": context,
        "bos_token_id": vocab.BOS_ID, "eos_token_id": vocab.EOS_ID, "pad_token_id": vocab.EOS_ID,
        "dtype": "float32", "exported_from": {"run": str(run.resolve()), "checkpoint": tag},
    }
    (target / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for name in REMOTE_FILES:
        shutil.copyfile(REMOTE / name, target / name)
    _write_tokenizer(target, vocab, context)
    (target / "README.md").write_text(_model_card(config, vocab, tag))


def _tensors_by_module_path(model):
    """Every parameter and persistent buffer under its module path (as transformers loads them), not under
    DeepSpeed's per-expert checkpoint names (moe/deepspeed_adapter.py)."""
    for layer in model.moe_layers():
        layer.use_module_path_keys()
    return model.state_dict().items()


def _write_tokenizer(target: Path, vocab, context: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from moe_scale.data.subwords import SubwordTokenizer

    if isinstance(vocab, SubwordTokenizer):   # the run's own BPE or tokenizer.json (its ids are the model's)
        tokenizer = Tokenizer.from_str(vocab.to_json())
    else:
        tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab.words)}, unk_token=vocab.UNK))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()   # the run's words: split at whitespace only
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{vocab.BOS} $A",
                                                             special_tokens=[(vocab.BOS, vocab.BOS_ID)])
    tokenizer.save(str(target / "tokenizer.json"))
    special = {"bos_token": vocab.BOS, "eos_token": vocab.EOS, "unk_token": vocab.UNK, "pad_token": vocab.EOS}
    (target / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context or 1_000_000_000,
         "clean_up_tokenization_spaces": False, **special}, indent=2) + "\n")
    (target / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _model_card(config, vocab, tag: str, native: str | None = None) -> str:
    """The README: what the model is and Python that loads it and generates (within a transformer's context);
    `native`: the transformers architecture of a native export (None: the remote code)."""
    if native is not None:
        return _native_card(config, vocab, tag, native)
    kind = "an LSTM-MoE" if config.model.kind == "lstm" else f"a transformer ({config.attention.kind} attention)"
    text = "Text is split at whitespace into the run's words; others become `<UNK>`." \
        if config.data.tokenizer == "words" else \
        f"Text is encoded with the run's tokenizer ({config.data.tokenizer}), {len(vocab)} tokens."
    context = config.data.seq_len if config.model.kind == "transformer" else 0
    new_tokens = max(1, min(20, context - len(vocab.encode(CARD_PROMPT)))) if context else 20
    positions = f", {context} positions at most (the context it was trained with)" if context else ""
    return f"""# moe_scale export

{kind} language model trained with moe_scale (checkpoint {tag}), a vocabulary of {len(vocab)}.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(".", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(".", trust_remote_code=True)   # config.json names the remote code
ids = tokenizer("{CARD_PROMPT}", return_tensors="pt").input_ids        # <S> is prepended
print(tokenizer.decode(model.generate(ids, do_sample=False, max_new_tokens={new_tokens})[0]))
```

Inference only, one device, float32; needs `moe_scale` installed (the remote code builds its model). The logits
are log-probabilities of the next token{positions}. `generate` re-reads the whole prefix each step (no cache is
handed to transformers). {text} Per-word perplexity as `moe-scale eval` computes it: moe_scale's docs/using-a-run.md,
"Exporting to HuggingFace transformers".
"""


def _native_card(config, vocab, tag: str, architecture: str) -> str:
    text = "Text is split at whitespace into the run's words; others become `<UNK>`." \
        if config.data.tokenizer == "words" else \
        f"Text is encoded with the run's tokenizer ({config.data.tokenizer}), {len(vocab)} tokens."
    context = config.data.seq_len
    new_tokens = max(1, min(20, context - len(vocab.encode(CARD_PROMPT))))
    return f"""# moe_scale export

A `{architecture}` (transformers' own class, no remote code) trained with moe_scale's `--block llama`
(checkpoint {tag}), a vocabulary of {len(vocab)}, trained on windows of {context} positions.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(".")
tokenizer = AutoTokenizer.from_pretrained(".")
ids = tokenizer("{CARD_PROMPT}", return_tensors="pt").input_ids        # <S> is prepended
print(tokenizer.decode(model.generate(ids, do_sample=False, max_new_tokens={new_tokens})[0]))
```

Its logits are moe_scale's (float32), and greedy `generate` picks the words `moe-scale generate --greedy` picks.
{text} `config.json` keeps the moe_scale run configuration under `run_config`; `moe-scale train --block llama
--init-from-hf DIR` continues training from this directory. Per-word perplexity as `moe-scale eval` computes it:
moe_scale's docs/using-a-run.md, "Exporting to HuggingFace transformers".
"""
