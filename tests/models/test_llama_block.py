"""The llama block (`--block llama`) against transformers' own Mixtral, Qwen2-MoE and Llama: its rotary positions
and RMSNorm equal transformers' functions; the whole model, written by weights/hf_native.py and loaded by
`AutoModelForCausalLM.from_pretrained` (no remote code), gives moe_scale's logits (float32, relative error
≤ 1e-4) with an MoE FFN (with gated shared experts: Qwen2-MoE) or a dense one, tied or untied embeddings; the
import reads back exactly what the export wrote (the released layouts and transformers 5's fused one; an
expert-parallel rank takes its experts), and a checkpoint of another shape (or with nonzero Qwen2 attention
biases) is refused in one line naming the field and its flag."""

from __future__ import annotations

import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from moe_scale.config import RunConfig
from moe_scale.errors import UserError
from moe_scale.weights import hf_native
from moe_scale.models.build import build_model

V = 50


def llama_config(ffn: str = "moe", tie: bool = False, **settings) -> RunConfig:
    router = dict(gate="softmax_topk", moa_renormalize="full") if ffn == "moe" else {}
    config = RunConfig.from_settings(**{**dict(
        model="transformer", block="llama", ffn=ffn, d_model=32, num_heads=4, num_layers=2, num_experts=4, top_k=2,
        expert_hidden=24, ffn_hidden=40, tie_embeddings=tie, seq_len=16, rope_theta=500.0, dropout=0.0),
        **router, **settings})
    config.validate()
    return config


QWEN = dict(shared_experts=2, shared_expert_hidden=12, shared_expert_gate=True)   # Qwen2-MoE: one of width 24


def kind_config(kind: str, tie: bool = False) -> RunConfig:
    """moe (Mixtral), qwen (Qwen2-MoE: MoE with gated shared experts) or dense (Llama)."""
    return llama_config("moe", tie, **QWEN) if kind == "qwen" else llama_config(kind, tie)


def llama_model(config: RunConfig, seed: int = 0, **build):
    """A llama-block model whose RMSNorm weights, router and shared-expert gate are not at their near-trivial
    initial values."""
    torch.manual_seed(seed)
    model = build_model(config, V, seed=seed, **build).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.norm1.weight.uniform_(0.5, 1.5)
            block.norm2.weight.uniform_(0.5, 1.5)
            if config.model.transformer.ffn == "moe":
                block.ffn.router.w_gate.normal_(0.0, 0.5)
            if getattr(block.ffn, "shared", None) is not None:
                block.ffn.shared.w_gate.normal_(0.0, 0.5)
    return model


def test_rotary_positions_and_rms_norm_are_transformers_own():
    from transformers.models.mixtral.modeling_mixtral import (MixtralRMSNorm, MixtralRotaryEmbedding,
                                                              apply_rotary_pos_emb)
    from transformers import MixtralConfig

    from moe_scale.attention.rotary import RotaryPositions
    from moe_scale.models.rms_norm import RMSNorm

    hf = MixtralConfig(hidden_size=32, num_attention_heads=4, head_dim=8, rope_theta=500.0)
    q, k = torch.randn(2, 4, 11, 8), torch.randn(2, 4, 11, 8)
    for start in (0, 5):
        positions = torch.arange(start, start + 11)[None]
        cos, sin = MixtralRotaryEmbedding(hf)(q, positions)
        for ours, theirs in zip(RotaryPositions(8, 500.0)(q, k, start=start), apply_rotary_pos_emb(q, k, cos, sin)):
            assert torch.equal(ours, theirs)
    x = torch.randn(3, 7, 32) * 5
    ours, theirs = RMSNorm(32), MixtralRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    assert torch.equal(ours(x), theirs(x))


def test_the_block_has_no_biases_and_a_tied_output_layer_is_the_embedding():
    untied, tied = build_model(llama_config(), V), build_model(llama_config(tie=True), V)
    assert not any(name.endswith("bias") for name, _ in untied.named_parameters())
    assert tied.softmax.proj.weight is tied.embedding.weight
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == V * 32
    expert_names = [n for n, _ in untied.named_parameters() if "expert" in n]
    assert expert_names and all(".ffn.experts.w_" in n for n in expert_names)   # DeepSpeed's expert test
    assert untied.blocks[0].ffn.experts.w_in.shape == (4, 48, 32)   # w1 and w3 stacked


def _write(directory, model, config) -> None:
    from safetensors.torch import save_file

    directory.mkdir()
    save_file(hf_native.export_tensors(model, config), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf_native.hf_config(config, V, 1, 2)))


ARCHITECTURES = {"moe": "MixtralForCausalLM", "qwen": "Qwen2MoeForCausalLM", "dense": "LlamaForCausalLM"}


@pytest.mark.parametrize("ffn", ["moe", "qwen", "dense"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_transformers_loads_the_export_natively_and_gives_the_same_logits(tmp_path, ffn, tie):
    from transformers import AutoModelForCausalLM

    config = kind_config(ffn, tie)
    model = llama_model(config)
    _write(tmp_path / "hf", model, config)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(theirs).__name__ == ARCHITECTURES[ffn]
    ids = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = theirs(ids).logits
        ours = model.softmax.proj(model.final_norm(_hidden(model, ids)))
    assert ((logits - ours).abs().max() / ours.abs().max()).item() <= 1e-4
    torch.testing.assert_close(logits.log_softmax(-1), model.decode(ids)[0], rtol=1e-4, atol=1e-5)


def _hidden(model, ids):
    """The last block's output (what the final norm reads)."""
    x = model.embedding(ids)
    for block in model.blocks:
        x, _ = block(x)
    return x


@pytest.mark.parametrize("ffn, layout", [("moe", "released"), ("moe", "fused"), ("qwen", "released"),
                                         ("qwen", "fused"), ("dense", "released")])
def test_import_reads_back_exactly_what_the_export_wrote(ffn, layout):
    config = kind_config(ffn)
    source = llama_model(config, seed=0)
    tensors = hf_native.export_tensors(source, config)
    if layout == "fused":   # transformers 5's in-memory layout: experts stacked, gate and up rows concatenated
        tensors = _fused(tensors, config)
    target = llama_model(config, seed=1)
    hf_native.import_tensors(target, config, tensors, "test")
    for name, value in hf_native.export_tensors(source, config).items():
        assert torch.equal(hf_native.export_tensors(target, config)[name], value), name


def _fused(tensors: dict, config) -> dict:
    """transformers 5's layout of Mixtral's (block_sparse_moe.experts.E.w1/w3/w2) or Qwen2-MoE's
    (mlp.experts.E.gate_proj/up_proj/down_proj) released experts."""
    qwen = config.moe.experts.shared > 0
    names = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
    out = {n: t for n, t in tensors.items() if ".block_sparse_moe." not in n and ".mlp.experts." not in n}
    for i in range(config.model.transformer.num_layers):
        moe, mlp = f"model.layers.{i}.{'mlp' if qwen else 'block_sparse_moe'}.", f"model.layers.{i}.mlp."
        experts = range(config.moe.experts.num_experts)
        out[mlp + "gate.weight"] = tensors[moe + "gate.weight"]
        out[mlp + "experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{moe}experts.{e}.{w}.weight"] for w in names[:2]]) for e in experts])
        out[mlp + "experts.down_proj"] = torch.stack([tensors[f"{moe}experts.{e}.{names[2]}.weight"]
                                                      for e in experts])
    return out


@pytest.mark.parametrize("layout", ["released", "fused"])
def test_an_expert_parallel_rank_imports_its_own_experts(layout):
    config = llama_config(num_experts=4)
    source = llama_model(config)
    tensors = hf_native.export_tensors(source, config)
    tensors = _fused(tensors, config) if layout == "fused" else tensors
    rank1 = build_model(config, V, ep_size=2, ep_rank=1)
    hf_native.import_tensors(rank1, config, tensors, "test")
    for ours, theirs in zip(rank1.blocks, source.blocks):
        assert torch.equal(ours.ffn.experts.w_in, theirs.ffn.experts.w_in[2:])
        assert torch.equal(ours.ffn.experts.w_out, theirs.ffn.experts.w_out[2:])
        assert torch.equal(ours.ffn.router.w_gate, theirs.ffn.router.w_gate)
    config.moe.experts.tensor_parallel = 2   # --etp-size 2: the last of 4 ranks, the second shard of experts 2-3
    shard = build_model(config, V, ep_size=4, ep_rank=3)
    hf_native.import_tensors(shard, config, tensors, "test")
    kind = shard.blocks[0].ffn.experts.kind
    for ours, theirs in zip(shard.blocks, source.blocks):
        w_in, w_out = theirs.ffn.experts.w_in.detach()[2:], theirs.ffn.experts.w_out.detach()[2:]
        f = w_out.shape[1] // 2
        assert torch.equal(ours.ffn.experts.w_in, torch.stack([kind.hidden_slice(w, 1, 2) for w in w_in]))
        assert torch.equal(ours.ffn.experts.w_out, w_out[:, f:])
        assert torch.equal(ours.ffn.router.w_gate, theirs.ffn.router.w_gate)


@pytest.mark.parametrize("field, value, flag", [
    ("hidden_size", 64, "--d-model"), ("num_local_experts", 8, "--num-experts"), ("num_experts_per_tok", 1, "--top-k"),
    ("intermediate_size", 99, "--expert-hidden"), ("rope_theta", 1e6, "--rope-theta"),
    ("tie_word_embeddings", True, "--tie-embeddings"), ("vocab_size", 7, "--vocab-size"),
    ("num_key_value_heads", 2, "no flag sets it"), ("rms_norm_eps", 1e-6, "set --rms-norm-eps"),
    ("model_type", "llama", "--ffn dense"), ("model_type", "qwen2_moe", "--shared-experts 1 --shared-expert-gate"),
    ("model_type", "gpt2", "only Mixtral, Qwen2-MoE, Qwen3-MoE, Llama and Qwen3"),
])
def test_a_checkpoint_of_another_shape_is_refused_naming_the_field(field, value, flag):
    config = llama_config()
    hf = hf_native.hf_config(config, V, 1, 2)
    hf[field] = value
    if field == "rope_theta":
        hf["rope_parameters"]["rope_theta"] = value
    with pytest.raises(UserError) as refused:
        hf_native.check_config(hf, config, V, "--init-from-hf DIR")
    message = str(refused.value)
    assert "\n" not in message and flag in message and (field in message or field == "model_type")
    hf_native.check_config(hf_native.hf_config(config, V, 1, 2), config, V, "--init-from-hf DIR")   # its own: fine


@pytest.mark.parametrize("field, value, flag", [
    ("moe_intermediate_size", 99, "--expert-hidden"), ("num_experts", 8, "--num-experts"),
    ("shared_expert_intermediate_size", 36, "--shared-expert-hidden"), ("norm_topk_prob", False, "no flag sets it"),
    ("decoder_sparse_step", 2, "no flag sets it"), ("mlp_only_layers", [1], "no flag sets it"),
    ("model_type", "mixtral", "--ffn moe without --shared-experts"),
])
def test_a_qwen2_moe_checkpoint_of_another_shape_is_refused_naming_the_field(field, value, flag):
    config = kind_config("qwen")
    hf = hf_native.hf_config(config, V, 1, 2)
    assert (hf["model_type"], hf["shared_expert_intermediate_size"]) == ("qwen2_moe", 24)
    hf[field] = value
    with pytest.raises(UserError) as refused:
        hf_native.check_config(hf, config, V, "--init-from-hf DIR")
    message = str(refused.value)
    assert "\n" not in message and flag in message and (field in message or field == "model_type")
    hf_native.check_config(hf_native.hf_config(config, V, 1, 2), config, V, "--init-from-hf DIR")   # its own: fine
    one_wide = hf_native.hf_config(kind_config("qwen"), V, 1, 2)   # 2 shared experts of 12 import as 1 of 24
    hf_native.check_config(one_wide, llama_config("moe", shared_experts=1, shared_expert_hidden=24,
                                                  shared_expert_gate=True), V, "--init-from-hf DIR")


def test_qwen2_moe_attention_biases_import_only_when_zero():
    config = kind_config("qwen")
    tensors = hf_native.export_tensors(llama_model(config), config)
    assert not torch.count_nonzero(tensors["model.layers.0.self_attn.q_proj.bias"])
    tensors["model.layers.1.self_attn.v_proj.bias"] = torch.full_like(tensors["model.layers.1.self_attn.v_proj.bias"],
                                                                       0.1)
    with pytest.raises(UserError, match="model.layers.1.self_attn.v_proj.bias is not zero"):
        hf_native.import_tensors(llama_model(config), config, tensors, "--init-from-hf DIR")


def test_a_missing_or_extra_tensor_is_refused_in_one_line():
    config = llama_config()
    tensors = hf_native.export_tensors(llama_model(config), config)
    missing = {n: t for n, t in tensors.items() if n != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(UserError, match="lack model.layers.1.self_attn.k_proj.weight"):
        hf_native.import_tensors(llama_model(config), config, missing, "--init-from-hf DIR")
    extra = {**tensors, "model.layers.0.mlp.shared_expert.up_proj.weight": torch.zeros(3)}
    with pytest.raises(UserError, match="shared_expert.up_proj.weight .*has no place"):
        hf_native.import_tensors(llama_model(config), config, extra, "--init-from-hf DIR")


@pytest.mark.parametrize("ffn", ["moe", "dense"])
def test_the_flop_accounting_counts_the_swiglu_ffns_three_matrices(ffn):
    """The transformer's per-token FFN multiply-adds (accounting/attention_flops.py) are what torch's FLOP counter
    measures in the llama block's FFNs: SwiGLU's three matrices, the router's d·E, k experts per token."""
    from torch.utils.flop_counter import FlopCounterMode

    from moe_scale.accounting.attention_flops import transformer_forward_macs_per_token
    from moe_scale.moe.kernel_policy import KernelPolicy, forced_policy

    config = llama_config(ffn)
    model = llama_model(config)
    x = torch.randn(3, 16, 32)
    torch_kernels = KernelPolicy(native_cpu=False, gate_chunk_rows=None, max_groups=None)   # the native ones
    with forced_policy(torch_kernels), FlopCounterMode(display=False) as counter, torch.no_grad():  # are not seen
        for block in model.blocks:
            if ffn == "moe":
                block.ffn(x.reshape(-1, 32))
            else:
                block.ffn(x)
    tokens = 3 * 16
    counted = transformer_forward_macs_per_token(config, V, 16)["ffn"]
    assert counter.get_total_flops() == 2 * tokens * counted
    matrices = 3 * 32 * (24 if ffn == "moe" else 40)
    assert counted == 2 * (2 * matrices + 32 * 4 if ffn == "moe" else matrices)   # 2 layers


def _saved(directory, config):
    """A complete transformers directory of `config`'s model: config.json and model.safetensors."""
    from safetensors.torch import save_file

    directory.mkdir()
    torch.manual_seed(0)
    (directory / "config.json").write_text(json.dumps(hf_native.hf_config(config, V, 1, 2)))
    save_file(hf_native.export_tensors(build_model(config, V), config), str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("damage, fragments", [
    ("cut short", ["model.safetensors is not a readable safetensors file", "copy it again"]),
    ("garbage", ["model.safetensors is not a readable safetensors file"]),
    ("index not json", ["model.safetensors.index.json is not a shard index", "JSONDecodeError"]),
    ("index without weight_map", ["model.safetensors.index.json is not a shard index", "KeyError"]),
    ("index names a missing shard", ["names the shard model-00002-of-00002.safetensors, which is not there"]),
])
def test_damaged_weights_from_elsewhere_are_one_line(tmp_path, damage, fragments):
    directory = _saved(tmp_path / "hf", llama_config())
    weights = directory / "model.safetensors"
    if damage == "cut short":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbage":
        weights.write_bytes(os.urandom(4096))
    else:
        index = directory / "model.safetensors.index.json"
        shards = {"index not json": "{not json", "index without weight_map": json.dumps({"metadata": {}}),
                  "index names a missing shard": json.dumps({"weight_map": {"a": "model.safetensors",
                                                                            "b": "model-00002-of-00002.safetensors"}})}
        index.write_text(shards[damage])
    with pytest.raises(UserError) as refused:
        hf_native.read_directory(directory)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"--init-from-hf {directory}: ")
    assert all(fragment in message for fragment in fragments), message


def test_an_unreadable_tokenizer_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(b"\xff\xfe not utf-8 \x80")
    with pytest.raises(UserError, match=r"--init-from-hf DIR: its tokenizer.json is not a tokenizer file"):
        hf_native.check_vocabulary(tmp_path, None, "--init-from-hf DIR")


def test_a_field_config_json_leaves_out_is_transformers_default_not_this_runs():
    """A Mixtral config.json without num_experts_per_tok is top-2 in transformers: a top-1 run refuses it."""
    hf = hf_native.hf_config(llama_config(top_k=1), V, 1, 2)
    del hf["num_experts_per_tok"]
    with pytest.raises(UserError, match="num_experts_per_tok is 2, this run's 1; set --top-k"):
        hf_native.check_config(hf, llama_config(top_k=1), V, "--init-from-hf DIR")
    hf_native.check_config(hf, llama_config(top_k=2), V, "--init-from-hf DIR")
