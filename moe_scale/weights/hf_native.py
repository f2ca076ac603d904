"""A --block llama model as transformers' own MixtralForCausalLM (MoE FFN), Qwen2MoeForCausalLM (MoE FFN with
shared experts), Qwen3MoeForCausalLM (MoE FFN, --qk-norm), LlamaForCausalLM (dense FFN) or Qwen3ForCausalLM (dense
FFN, --qk-norm), and back: one name mapping, used by `moe-scale export --format
hf` (no remote code: plain `AutoModelForCausalLM.from_pretrained(DIR)` loads it) and by `train --init-from-hf
DIR`.

Weights are written under the names Mixtral's released checkpoints use (`model.layers.N.block_sparse_moe.gate`,
`...experts.E.w1/w2/w3`), which every transformers since 4.36 loads (5.x converts them to its fused
`mlp.experts.gate_up_proj` / `down_proj` on loading); the import reads either layout. moe_scale → transformers:

    embedding.weight                   model.embed_tokens.weight
    blocks.N.norm1 / norm2             model.layers.N.input_layernorm / post_attention_layernorm
    blocks.N.attn.{q,k,v}_proj, out_proj   model.layers.N.self_attn.{q,k,v}_proj, o_proj
    blocks.N.ffn.router.w_gate [D, E]  model.layers.N.block_sparse_moe.gate.weight [E, D] (transposed)
    blocks.N.ffn.experts.w_in[e]       ...experts.e.w1 (rows 0..F-1) and w3 (rows F..2F-1)
    blocks.N.ffn.experts.w_out[e]      ...experts.e.w2 (transposed)
    blocks.N.ffn.{gate,up,down}_proj   model.layers.N.mlp.{gate,up,down}_proj (Llama)
    final_norm, softmax.proj           model.norm, lm_head (absent when tied)

Qwen2-MoE (shared experts): the router is `model.layers.N.mlp.gate`, expert e's matrices `mlp.experts.e.gate_proj /
up_proj / down_proj` (its released names; 5.x fuses them as Mixtral's), the S shared experts of width h_s are its one
`mlp.shared_expert` of intermediate size S·h_s (`gate_proj`, `up_proj`, `down_proj`: blocks.N.ffn.shared's own
names) and `blocks.N.ffn.shared.w_gate [D]` is `mlp.shared_expert_gate.weight [1, D]`. Qwen2's attention has q/k/v
biases: they are written as zeros (`qkv_bias` true, so every transformers loads them) and must be zero to import.

Qwen3-MoE (no shared expert; `--qk-norm`): Qwen2-MoE's expert and router names, plus each attention's
`self_attn.q_norm` / `k_norm` [head_dim] (blocks.N.attn.q_norm / k_norm), no attention biases, `norm_topk_prob`
true (the chosen probabilities renormalised, as the llama block's softmax top-k does). Qwen3 (dense): Llama's
names plus the same q/k norms.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_scale.errors import UserError
from moe_scale.moe.experts.kinds import expert_kind
from moe_scale.moe.router import gate_class
from moe_scale.models.blocks import LLAMA_INIT_STD, block_kind

_LEGACY = "model.layers.{}.block_sparse_moe."   # Mixtral's released checkpoints (and transformers 4.x)
_FUSED = "model.layers.{}.mlp."                 # transformers 5's own layout (and Qwen2-MoE's released one)
# per-expert names of the released layouts: prefix, then the gate, up and down matrices
_RELEASED = {"mixtral": (_LEGACY, "w1", "w3", "w2"), "qwen2_moe": (_FUSED, "gate_proj", "up_proj", "down_proj"),
             "qwen3_moe": (_FUSED, "gate_proj", "up_proj", "down_proj")}
# Where this run's flags differ from a checkpoint of another model_type: what to pass instead.
_INSTEAD = {"mixtral": "--ffn moe without --shared-experts or --qk-norm", "llama": "--ffn dense without --qk-norm",
            "qwen2_moe": "--ffn moe --shared-experts 1 --shared-expert-gate", "qwen3_moe": "--ffn moe --qk-norm",
            "qwen3": "--ffn dense --qk-norm"}
# The positions a native export accepts: its rotary positions have no table (no learned one, none precomputed), each
# is rotated by an angle computed from its index as a float32 (attention/rotary.py, transformers alike), which holds
# every index below 2^24 exactly. config.json's `max_position_embeddings` and the tokenizer's `model_max_length`
# say so, rather than the trained --seq-len (past which transformers warns, and its default `generate` length
# stops); how well the model does past its trained context is another matter (docs/transformers.md).
ROTARY_MAX_POSITIONS = 2 ** 24


def is_native(config) -> bool:
    """Whether a run exports natively (its transformer has the llama block)."""
    return config.model.kind == "transformer" and block_kind(config).exports_natively


def architecture(config) -> tuple[str, str]:
    """(model_type, architecture) of a llama-block run: Mixtral with an MoE FFN, Qwen2-MoE with shared experts
    too, Qwen3-MoE with q/k norms; Llama with a dense FFN, Qwen3 with q/k norms."""
    qk_norm = config.model.transformer.qk_norm
    if config.model.transformer.ffn == "moe":
        if not gate_class(config.moe.router).exports_as_mixtral(config.moe.router):
            raise UserError(f"--gate {config.moe.router.gate}: transformers' Mixtral and Qwen-MoE routers do not "
                            f"compute it, so this run has no native export")
        if config.moe.experts.shared and qk_norm:
            raise UserError("--shared-experts with --qk-norm: no transformers MoE has both (Qwen2-MoE has shared "
                            "experts, Qwen3-MoE q/k norms), so this run has no native export")
        if config.moe.experts.shared:
            return "qwen2_moe", "Qwen2MoeForCausalLM"
        if qk_norm:
            return "qwen3_moe", "Qwen3MoeForCausalLM"
        return "mixtral", "MixtralForCausalLM"
    return ("qwen3", "Qwen3ForCausalLM") if qk_norm else ("llama", "LlamaForCausalLM")


def hf_config(config, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    """transformers' config.json for the run (what Mixtral/Qwen2Moe/LlamaConfig(...).to_dict() holds, for 4.x
    and 5.x)."""
    transformer, attention, d = config.model.transformer, config.attention, config.model.d_model
    model_type, arch = architecture(config)
    theta = transformer.rope_theta
    out = {
        "architectures": [arch], "model_type": model_type, "vocab_size": vocab_size, "hidden_size": d,
        "num_hidden_layers": transformer.num_layers, "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.num_heads, "head_dim": attention.head_width(d),
        "hidden_act": expert_kind(config.expert_kind).hf_act if config.has_moe_ffn else "silu",
        "max_position_embeddings": ROTARY_MAX_POSITIONS, "initializer_range": LLAMA_INIT_STD,
        "rms_norm_eps": transformer.rms_norm_eps, "rope_theta": theta, "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": theta},
        "attention_dropout": 0.0, "tie_word_embeddings": transformer.tie_embeddings, "use_cache": True,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None, "dtype": "float32",
    }
    if model_type == "mixtral":
        router = config.moe.router
        out.update({
            "intermediate_size": config.moe.experts.hidden, "num_local_experts": config.moe.experts.num_experts,
            "num_experts_per_tok": router.top_k, "sliding_window": None, "router_jitter_noise": 0.0,
            "output_router_logits": False,
            # transformers' balancing loss pools every layer's tokens and is k times a switch loss: with this
            # coefficient it equals moe_scale's sum of per-layer losses when the layers route alike (no z-loss)
            "router_aux_loss_coef": router.softmax_topk.aux_weight * transformer.num_layers / router.top_k})
    elif model_type == "qwen2_moe":
        router, experts = config.moe.router, config.moe.experts
        shared = experts.shared * (experts.shared_hidden or experts.hidden)
        out.update({
            "intermediate_size": shared, "moe_intermediate_size": experts.hidden,
            "shared_expert_intermediate_size": shared, "num_experts": experts.num_experts,
            "num_experts_per_tok": router.top_k, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "qkv_bias": True, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": transformer.num_layers, "output_router_logits": False,
            # the same balancing loss as Mixtral's (see above)
            "router_aux_loss_coef": router.softmax_topk.aux_weight * transformer.num_layers / router.top_k})
    elif model_type == "qwen3_moe":
        router, experts = config.moe.router, config.moe.experts
        out.update({
            "intermediate_size": experts.hidden, "moe_intermediate_size": experts.hidden,
            "num_experts": experts.num_experts, "num_experts_per_tok": router.top_k, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": transformer.num_layers, "output_router_logits": False,
            # the same balancing loss as Mixtral's (see above)
            "router_aux_loss_coef": router.softmax_topk.aux_weight * transformer.num_layers / router.top_k})
    elif model_type == "qwen3":
        out.update({"intermediate_size": transformer.ffn_hidden, "attention_bias": False, "use_sliding_window": False,
                    "sliding_window": None, "max_window_layers": transformer.num_layers})
    else:
        out.update({"intermediate_size": transformer.ffn_hidden, "attention_bias": False, "mlp_bias": False,
                    "pretraining_tp": 1})
    return out


# ---------------------------------------------------------------- moe_scale -> transformers


def export_tensors(model, config) -> dict[str, torch.Tensor]:
    """Every weight of a one-process llama-block model (all experts local) under transformers' names."""
    out = {"model.embed_tokens.weight": model.embedding.weight, "model.norm.weight": model.final_norm.weight}
    if not config.model.transformer.tie_embeddings:
        out["lm_head.weight"] = model.softmax.proj.weight
    for i, block in enumerate(model.blocks):
        out.update(_block_tensors(i, block, config))
    return {name: t.detach().cpu().clone().contiguous() for name, t in out.items()}


def _block_tensors(i: int, block, config) -> dict[str, torch.Tensor]:
    layer, attn = f"model.layers.{i}.", block.attn
    out = {layer + "input_layernorm.weight": block.norm1.weight,
           layer + "post_attention_layernorm.weight": block.norm2.weight,
           layer + "self_attn.q_proj.weight": attn.q_proj.weight,
           layer + "self_attn.k_proj.weight": attn.k_proj.weight,
           layer + "self_attn.v_proj.weight": attn.v_proj.weight,
           layer + "self_attn.o_proj.weight": attn.out_proj.weight}
    if attn.q_norm is not None:   # Qwen3's
        out[layer + "self_attn.q_norm.weight"], out[layer + "self_attn.k_norm.weight"] = \
            attn.q_norm.weight, attn.k_norm.weight
    ffn = block.ffn
    if config.model.transformer.ffn == "dense":
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{layer}mlp.{name}.weight"] = getattr(ffn, name).weight
        return out
    model_type, _ = architecture(config)
    prefix, w_gate, w_up, w_down = _RELEASED[model_type]
    moe = prefix.format(i)
    out[moe + "gate.weight"] = ffn.router.w_gate.t()
    f = ffn.experts.d_hidden
    for e in range(ffn.experts.num_local_experts):
        w_in, w_out = ffn.experts.w_in[e], ffn.experts.w_out[e]
        out[f"{moe}experts.{e}.{w_gate}.weight"], out[f"{moe}experts.{e}.{w_up}.weight"] = w_in[:f], w_in[f:]
        out[f"{moe}experts.{e}.{w_down}.weight"] = w_out.t()
    if model_type == "qwen2_moe":
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{moe}shared_expert.{name}.weight"] = getattr(ffn.shared, name).weight
        out[moe + "shared_expert_gate.weight"] = ffn.shared.w_gate[None, :]
        for name in ("q_proj", "k_proj", "v_proj"):   # Qwen2's attention biases: zero
            weight = getattr(attn, name).weight
            out[f"{layer}self_attn.{name}.bias"] = weight.new_zeros(weight.shape[0])
    return out


# ---------------------------------------------------------------- transformers -> moe_scale


def read_directory(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, every tensor) of a transformers model directory: model.safetensors or its shards."""
    from safetensors.torch import load_file

    where = f"--init-from-hf {directory}"
    try:
        hf = json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{where}: no config.json there; pass the directory `moe-scale export --format hf` wrote "
                        f"(or a MixtralForCausalLM / LlamaForCausalLM saved by transformers)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{where}: config.json is not readable JSON ({e})") from None
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{where}: {index.name} is not a shard index (a JSON object with a weight_map: "
                            f"{type(e).__name__}: {e}); save the model again with transformers") from None
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise UserError(f"{where}: no model.safetensors (or its index) there; save the model with safetensors "
                        f"(transformers' default)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise UserError(f"{where}: {index.name} names the shard {name}, which is not there; copy the whole "
                            f"directory, or save the model again")
        try:
            tensors.update(load_file(str(path)))
        except Exception as e:   # safetensors' SafetensorError (not importable by name in every version), OSError
            raise UserError(f"{where}: {name} is not a readable safetensors file ({e}); it may be cut short: "
                            f"copy it again") from None
    return hf, tensors


def check_config(hf: dict, config, vocab_size: int, where: str) -> None:
    """Refuses, in one line naming the field and the flag that sets it, a checkpoint of another shape."""
    expected = hf_config(config, vocab_size, 1, 2)
    model_type, _ = architecture(config)
    if hf.get("model_type") != model_type:
        other = _INSTEAD.get(hf.get("model_type"))
        raise UserError(f"{where}: it holds a {hf.get('model_type')!r} model and this run builds {model_type!r}; "
                        + (f"pass {other}" if other else "only Mixtral, Qwen2-MoE, Qwen3-MoE, Llama and Qwen3 "
                                                         "checkpoints import"))
    moe, qwen = model_type not in ("llama", "qwen3"), model_type == "qwen2_moe"
    qwen3 = model_type in ("qwen3_moe", "qwen3")
    flags = {"vocab_size": "the vocabulary (--vocab-size, --tokenizer)", "hidden_size": "--d-model",
             "num_hidden_layers": "--num-layers", "num_attention_heads": "--num-heads", "head_dim": "--head-dim",
             "intermediate_size": "--expert-hidden" if moe and not qwen else "--ffn-hidden",
             "rope_theta": "--rope-theta", "tie_word_embeddings": "--tie-embeddings / --no-tie-embeddings",
             "num_local_experts": "--num-experts", "num_experts": "--num-experts", "num_experts_per_tok": "--top-k",
             "moe_intermediate_size": "--expert-hidden",
             "shared_expert_intermediate_size": "--shared-experts × --shared-expert-hidden (their product)",
             "rms_norm_eps": "--rms-norm-eps"}
    theirs = {**_transformers_defaults(model_type), **hf}   # what transformers takes where config.json is silent
    theirs.setdefault("head_dim", None)
    if theirs["head_dim"] is None:
        theirs["head_dim"] = hf.get("hidden_size", 0) // max(1, hf.get("num_attention_heads", 1))
    theirs.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    theirs.setdefault("tie_word_embeddings", moe is False)   # transformers' defaults: Llama ties, MoEs do not
    theirs.setdefault("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    theirs.setdefault("rms_norm_eps", 1e-6 if not moe or qwen or qwen3 else 1e-5)
    if qwen3:   # Qwen3(-MoE)Config's defaults; intermediate_size sizes only mlp_only_layers' FFNs in the MoE
        theirs.setdefault("norm_topk_prob", False)
        theirs["mlp_only_layers"] = theirs.get("mlp_only_layers") or []
        if model_type == "qwen3_moe":
            theirs["intermediate_size"] = expected["intermediate_size"]
        if not theirs.get("use_sliding_window"):
            theirs["sliding_window"] = None
    if qwen:   # Qwen2MoeConfig's defaults; intermediate_size sizes only mlp_only_layers' FFNs (there are none)
        theirs.update(intermediate_size=expected["intermediate_size"], max_window_layers=None)
        theirs.setdefault("norm_topk_prob", False)
        theirs.setdefault("decoder_sparse_step", 1)
        theirs["mlp_only_layers"] = theirs.get("mlp_only_layers") or []
        if not theirs.get("use_sliding_window"):
            theirs["sliding_window"] = None
    theirs.setdefault("hidden_act", "silu")
    theirs.setdefault("sliding_window", None)
    for field in (*flags, "num_key_value_heads", "hidden_act", "sliding_window", "attention_bias",
                  "mlp_bias", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
        if field not in expected or theirs.get(field, expected[field]) == expected[field]:
            continue
        if field == "sliding_window" and (theirs[field] or 0) >= config.data.seq_len:
            continue   # a window longer than the context changes nothing
        value = theirs[field]
        if field in flags:
            raise UserError(f"{where}: its {field} is {value}, this run's {expected[field]}; set {flags[field]} to "
                            f"match it")
        raise UserError(f"{where}: its {field} is {value}, and the llama block has {expected[field]} (no flag "
                        f"sets it); only checkpoints with {field} {expected[field]} import")


# The fields whose default transformers' config class sets outright (others it derives, e.g. head_dim).
_DEFAULTED = ("num_experts_per_tok", "num_local_experts", "num_experts", "intermediate_size", "moe_intermediate_size",
              "shared_expert_intermediate_size", "vocab_size", "hidden_size", "num_hidden_layers",
              "num_attention_heads")


def _transformers_defaults(model_type: str) -> dict:
    """transformers' own defaults of `model_type`'s config for the fields in _DEFAULTED (a top-2 Mixtral whose
    config.json lacks num_experts_per_tok is top-2 there, whatever this run's --top-k)."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    return {field: defaults[field] for field in _DEFAULTED if defaults.get(field) is not None}


def check_vocabulary(directory: Path, vocab, where: str) -> None:
    """The checkpoint's embedding rows must mean this run's tokens: its tokenizer.json's vocabulary must be the
    run's, id for id."""
    from tokenizers import Tokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{where}: no tokenizer.json there, so its token ids cannot be checked against this run's "
                        f"vocabulary; export the model with `moe-scale export` (or save its tokenizer beside it)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:   # tokenizers raises a bare Exception on bad JSON or bytes
        raise UserError(f"{where}: its tokenizer.json is not a tokenizer file tokenizers reads ({e}); export the "
                        f"model again, or pass the directory of a complete checkpoint") from None
    theirs = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    ours = {i: t for t, i in vocab.tokenizer.get_vocab(with_added_tokens=True).items()} \
        if hasattr(vocab, "tokenizer") else dict(enumerate(vocab.words))
    if theirs != ours:
        first = min(i for i in set(theirs) | set(ours) if theirs.get(i) != ours.get(i))
        raise UserError(f"{where}: its vocabulary ({len(theirs)} tokens) is not this run's ({len(ours)}; first "
                        f"difference at id {first}: {theirs.get(first)!r} there, {ours.get(first)!r} here); train "
                        f"on the --data, --vocab-size and --tokenizer it was trained with, or pass --tokenizer "
                        f"{path}")


def import_tensors(model, config, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copies a checkpoint's tensors into a llama-block model; an expert-parallel rank takes its experts' rows.
    A tensor missing, of another shape, or without a place in the model is refused in one line."""
    tensors = dict(tensors)
    if architecture(config)[0] == "qwen2_moe":
        _drop_zero_attention_biases(tensors, where)
    wanted = _wanted(model, config, tensors, where)
    for name, (target, source_of) in wanted.items():
        if name not in tensors:
            raise UserError(f"{where}: its weights lack {name}; pass a complete checkpoint of this architecture")
        value = source_of(tensors.pop(name))
        if value.shape != target.shape:
            raise UserError(f"{where}: {name} has shape {tuple(value.shape)}, this run needs {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
    if config.model.transformer.tie_embeddings:   # a tied checkpoint may still carry its (equal) lm_head
        tensors.pop("lm_head.weight", None)
    leftover = sorted(name for name in tensors if not name.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise UserError(f"{where}: {leftover[0]} (and {len(leftover) - 1} more) has no place in a --block llama "
                        f"model; only Mixtral / Qwen2-MoE / Qwen3-MoE / Llama / Qwen3 checkpoints without extra "
                        f"modules import")


def _drop_zero_attention_biases(tensors: dict, where: str) -> None:
    """Qwen2's q/k/v biases: the llama block's attention has none, so they import only when zero."""
    for name in [n for n in tensors if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]:
        if torch.count_nonzero(tensors.pop(name)):
            raise UserError(f"{where}: {name} is not zero, and the llama block's attention has no biases; only "
                            f"Qwen2-MoE checkpoints with zero q/k/v biases (what `moe-scale export` writes) import")


def _wanted(model, config, tensors: dict, where: str) -> dict:
    """checkpoint name -> (the model's tensor to fill, how to read it from the checkpoint's)."""
    same = lambda t: t   # noqa: E731
    table = _my_rows(model.embedding)   # an expert-parallel rank holding some rows of the vocabulary tables
    wanted = {"model.embed_tokens.weight": (model.embedding.weight, table),
              "model.norm.weight": (model.final_norm.weight, same)}
    if not config.model.transformer.tie_embeddings:
        wanted["lm_head.weight"] = (model.softmax.proj.weight, table)
    for i, block in enumerate(model.blocks):
        layer, attn = f"model.layers.{i}.", block.attn
        wanted.update({layer + "input_layernorm.weight": (block.norm1.weight, same),
                       layer + "post_attention_layernorm.weight": (block.norm2.weight, same),
                       layer + "self_attn.q_proj.weight": (attn.q_proj.weight, same),
                       layer + "self_attn.k_proj.weight": (attn.k_proj.weight, same),
                       layer + "self_attn.v_proj.weight": (attn.v_proj.weight, same),
                       layer + "self_attn.o_proj.weight": (attn.out_proj.weight, same)})
        if attn.q_norm is not None:
            wanted.update({layer + "self_attn.q_norm.weight": (attn.q_norm.weight, same),
                           layer + "self_attn.k_norm.weight": (attn.k_norm.weight, same)})
        if config.model.transformer.ffn == "dense":
            wanted.update({f"{layer}mlp.{name}.weight": (getattr(block.ffn, name).weight, same)
                           for name in ("gate_proj", "up_proj", "down_proj")})
        else:
            wanted.update(_expert_sources(i, block.ffn, tensors, architecture(config)[0]))
        if getattr(block.ffn, "shared", None) is not None:   # Qwen2-MoE's shared expert and its gate
            shared, mlp = block.ffn.shared, _FUSED.format(i)
            wanted.update({f"{mlp}shared_expert.{name}.weight": (getattr(shared, name).weight, same)
                           for name in ("gate_proj", "up_proj", "down_proj")})
            wanted[mlp + "shared_expert_gate.weight"] = (shared.w_gate, lambda t: t[0] if t.shape[:1] == (1,) else t)
    return wanted


def _my_rows(embedding):
    """How to read this rank's rows of a vocabulary table: all of them, or those a row-split table holds."""
    rows = getattr(getattr(embedding, "vocab", None), "rows", None)
    if rows is None:
        return lambda t: t
    return lambda t: t[rows.first:rows.first + rows.count] if t.shape[0] == rows.total else t


def _expert_sources(i: int, layer, tensors: dict, model_type: str) -> dict:
    """The router and this rank's experts, from Mixtral's (Qwen2-MoE's) released layout or transformers 5's
    fused one."""
    experts = layer.experts
    first, local, f = experts.first_global_expert, experts.num_local_experts, experts.d_hidden
    fused = _FUSED.format(i)
    if fused + "experts.gate_up_proj" in tensors:   # [E, 2F, D] (gate rows, then up rows) and [E, D, F]
        mine = slice(first, first + local)   # (with --etp-size: each expert's shard of them)
        return {fused + "gate.weight": (layer.router.w_gate, lambda t: t.t()),
                fused + "experts.gate_up_proj": (experts.w_in, lambda t: torch.stack(
                    [experts.in_shard(w) for w in t[mine]])),
                fused + "experts.down_proj": (experts.w_out, lambda t: torch.stack(
                    [experts.out_shard(w.t()) for w in t[mine]]))}
    prefix, w_gate, w_up, w_down = _RELEASED[model_type]
    moe = prefix.format(i)
    out = {moe + "gate.weight": (layer.router.w_gate, lambda t: t.t())}
    hidden = experts.out_shard   # a [F, D] matrix's rows of this rank's hidden units
    for local_id in range(local):
        e = first + local_id
        out[f"{moe}experts.{e}.{w_gate}.weight"] = (experts.w_in[local_id, :f], hidden)
        out[f"{moe}experts.{e}.{w_up}.weight"] = (experts.w_in[local_id, f:], hidden)
        out[f"{moe}experts.{e}.{w_down}.weight"] = (experts.w_out[local_id], lambda t: hidden(t.t()))
    for e in [*range(first), *range(first + local, layer.num_experts)]:   # other ranks' experts: not here
        for w in (w_gate, w_up, w_down):
            tensors.pop(f"{moe}experts.{e}.{w}.weight", None)
    return out


def init_from_hf(model, config, vocab) -> None:
    """--init-from-hf: the model's weights from the directory's (checked against the run's shapes and
    vocabulary first)."""
    directory = Path(config.train.init_from_hf)
    where = f"--init-from-hf {directory}"
    if not directory.is_dir():
        raise UserError(f"{where}: no such directory; pass the directory `moe-scale export --format hf` wrote")
    hf, tensors = read_directory(directory)
    check_config(hf, config, len(vocab), where)
    check_vocabulary(directory, vocab, where)
    import_tensors(model, config, tensors, where)
