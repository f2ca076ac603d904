"""The typed config, its flags, and the DeepSpeed JSON checks."""

from __future__ import annotations

import json
import re

import pytest

from moe_scale.cli import build_parser
from moe_scale.commands.config_flags import config_from_args as _config_from_args
from moe_scale.config import RunConfig
from moe_scale.errors import UserError
from moe_scale.layout.ds_config import DEFAULT_DS_CONFIG, complete_ds_config, load_ds_config, validate_ds_config
from tests.paths import DS_CONFIGS

SHIPPED_DS_CONFIGS = sorted(DS_CONFIGS.glob("*.json"))


def parse(*argv: str) -> RunConfig:
    return _config_from_args(build_parser().parse_args(["train", *argv]))


def test_every_setting_is_a_flag_and_round_trips():
    config = RunConfig()
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    leaves = RunConfig.leaves()
    assert len(leaves) == len({leaf.path for leaf in leaves.values()})      # one key per setting, keys unique
    for key, leaf in leaves.items():
        assert leaf.flag in help_text, key
        assert config.get(key) == leaf.field.default
    assert RunConfig.from_dict(json.loads(json.dumps(config.to_dict())), "test") == config
    assert config.to_dict()["format"] == 2 and set(config.to_dict()["moe"]) == {"router", "dispatch", "experts"}


def test_flat_config_json_of_the_previous_format_is_migrated(tmp_path):
    """A run written before the component tree: sections model, data, train with flat keys."""
    old = {"model": {"num_experts": 32, "top_k": 4, "gate": "hierarchical", "num_groups": 8, "dispatch": "capacity",
                     "attention": "moa", "model": "transformer", "moa_top_k": 3, "lstm_hidden": 256},
           "data": {"seq_len": 20},
           "train": {"ep_size": 2, "softmax": "sampled", "out": "runs/x", "stream": True, "all_to_all": "hierarchical"}}
    config = RunConfig.from_dict(old, "old")
    assert (config.moe.experts.num_experts, config.moe.router.top_k, config.moe.router.gate) == (32, 4, "hierarchical")
    assert (config.moe.router.hierarchical.num_groups, config.moe.dispatch.mode) == (8, "capacity")
    assert (config.model.kind, config.attention.kind, config.attention.moa.top_k) == ("transformer", "moa", 3)
    assert (config.model.lstm.hidden, config.data.seq_len, config.parallel.ep_size) == (256, 20, 2)
    assert (config.softmax.kind, config.run.out, config.data.stream) == ("sampled", "runs/x", True)
    assert config.moe.dispatch.all_to_all == "hierarchical"


@pytest.mark.parametrize("raw, fragment", [
    ({"format": 2, "moe": {"router": {"gatee": "x"}}}, "unknown key(s) ['gatee'] in 'moe.router'"),
    ({"format": 2, "model": {"dropout": "abc"}}, "'model.dropout' must be float"),
    ({"format": 2, "moe": {"experts": {"num_experts": None}}}, "'moe.experts.num_experts' must be int"),
    ({"format": 2, "moe": {"dispatch": {"mode": "dropfull"}}}, "must be one of dropless, capacity"),
    ({"format": 2, "moe": 3}, "'moe' must be an object"),
    ({"format": 9}, "format 9 is newer"),
    ({"model": {"dropout": "abc"}}, "'model.dropout' must be float"),
    ({"train": {"noisy": 1}}, "unknown key(s) ['noisy'] in section 'train'"),
])
def test_edited_config_json_is_one_line_naming_the_key(raw, fragment):
    with pytest.raises(UserError) as error:
        RunConfig.from_dict(raw, "config.json")
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_flags_override_defaults_and_saved_config(tmp_path):
    config = parse("--num-experts", "32", "--top-k", "4", "--ep-size", "2", "--no-noisy-gating", "--data", "x.txt",
                   "--seed", "7", "--max-steps", "9", "--out", "somewhere")
    assert (config.moe.experts.num_experts, config.moe.router.top_k, config.moe.router.noisy_gating) == (32, 4, False)
    assert (config.parallel.ep_size, config.train.seed, config.train.max_steps, config.run.out) == \
        (2, 7, 9, "somewhere")
    assert config.data.data == "x.txt"
    saved = tmp_path / "config.json"
    config.run.resume = True
    config.save(saved)
    reloaded = parse("--config", str(saved), "--top-k", "2")
    assert reloaded.moe.experts.num_experts == 32 and reloaded.moe.router.top_k == 2
    assert reloaded.run.resume is False             # a reloaded config starts a new run unless told
    assert parse("--config", str(tmp_path)).moe.experts.num_experts == 32   # a run directory works too


def test_launcher_local_rank_is_accepted():
    args = build_parser().parse_args(["--local_rank=1", "train", "--max-steps", "3"])
    assert _config_from_args(args).train.max_steps == 3


@pytest.mark.parametrize("argv, fragment", [
    (["--top-k", "3", "--num-experts", "2"], "--top-k 3"),
    (["--num-experts", "6", "--ep-size", "4"], "not divisible by --ep-size"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--dropout", "1.5"], "--dropout"),
    (["--resume", "--overwrite"], "contradict"),
])
def test_invalid_flags(argv, fragment):
    with pytest.raises(UserError, match=fragment.replace("-", r"\-")):
        parse(*argv)


def test_cpu_json_is_the_built_in_default():
    assert json.loads((DS_CONFIGS / "cpu.json").read_text()) == DEFAULT_DS_CONFIG
    assert load_ds_config(None) == DEFAULT_DS_CONFIG


@pytest.mark.parametrize("path", SHIPPED_DS_CONFIGS, ids=lambda p: p.name)
def test_shipped_ds_configs_validate(path):
    assert load_ds_config(str(path))


def test_ds_config_checks():
    with pytest.raises(UserError, match="did you mean 'gradient_clipping'"):
        validate_ds_config({"gradient_cliping": 1.0}, "x")
    with pytest.raises(UserError, match="stage 3"):
        validate_ds_config({"zero_optimization": {"stage": 3}}, "x")
    done = complete_ds_config({"train_batch_size": "auto", "zero_optimization": {"stage": 2}}, 4, 2, 2, "x")
    assert (done["train_batch_size"], done["train_micro_batch_size_per_gpu"], done["gradient_accumulation_steps"]) \
        == (16, 4, 2)
    assert done["zero_allow_untested_optimizer"] is True
    with pytest.raises(UserError, match="gradient_accumulation_steps"):
        complete_ds_config({"gradient_accumulation_steps": 3}, 4, 2, 2, "x")


@pytest.mark.parametrize("argv, fragment", [
    (["--gate", "hierarchical", "--num-experts", "16", "--num-groups", "3"], "--num-groups 3 must divide"),
    (["--gate", "hierarchical", "--num-experts", "16", "--num-groups", "4", "--top-k", "5"], "primary k"),
    (["--gate", "hierarchical", "--num-experts", "16", "--num-groups", "4", "--top-k-secondary", "5"],
     "--top-k-secondary 5"),
    (["--gate", "hierarchical", "--num-experts", "16", "--num-groups", "2", "--ep-size", "4"],
     "not divisible by --ep-size"),
    (["--gate", "batchwise", "--num-experts", "4", "--top-k", "5"], "--top-k 5"),
    (["--gate", "aux_free", "--bias-update-rate", "-0.001"], "--bias-update-rate -0.001 is outside"),
    (["--gate", "aux_free", "--bias-update-rate", "2"], "--bias-update-rate 2 is outside"),
    (["--gate", "aux_free", "--seq-balance-weight", "20"], "--seq-balance-weight 20 is outside"),
    (["--shared-experts", "-1"], "--shared-experts and --shared-expert-hidden must not be negative"),
    (["--shared-experts", "1", "--shared-expert-hidden", "-4"], "must not be negative \\(got 1, -4\\)"),
])
def test_invalid_gate_parameters(argv, fragment):
    with pytest.raises(UserError, match=fragment.replace("-", r"\-")):
        parse(*argv)


@pytest.mark.parametrize("argv, fragment", [
    (["--attention", "moa"], "--attention does nothing here: it needs --model transformer"),
    (["--num-layers", "4"], "--num-layers does nothing here: it needs --model transformer"),
    (["--model", "transformer", "--layout", "4xlstm"], "--layout does nothing here: it needs --model lstm"),
    (["--layout", "4xlstm", "--num-experts", "8"], "--num-experts does nothing here: it needs an MoE layer"),
    (["--model", "transformer", "--gate", "hierarchical"], "--gate does nothing here: it needs an MoE layer"),
    (["--num-groups", "4"], "--num-groups does nothing here: it needs --gate hierarchical"),
    (["--gate", "softmax_topk", "--w-load", "0.2"], "--w-load does nothing here: it needs --gate noisy_topk"),
    (["--moa-aux-weight", "0.1"], "--moa-aux-weight does nothing here: it needs --gate softmax_topk or --attention"),
    (["--capacity-factor", "2"], "--capacity-factor does nothing here: it needs --dispatch capacity"),
    (["--node-size", "4"], "--node-size does nothing here: it needs --all-to-all hierarchical"),
    (["--num-sampled", "10"], "--num-sampled does nothing here: it needs --softmax sampled"),
    (["--token-budget", "100"], "--token-budget does nothing here: it needs --stream"),
    (["--ffn-layers", "2"], "--ffn-layers does nothing here: it needs --layout lstm-ffn-lstm"),
    (["--bias-update-rate", "0.01"], "--bias-update-rate does nothing here: it needs --gate aux_free"),
    (["--gate", "softmax_topk", "--aux-free-score", "softmax"],
     "--aux-free-score does nothing here: it needs --gate aux_free"),
    (["--shared-expert-gate"], "--shared-expert-gate does nothing here: it needs --shared-experts 1 or more"),
    (["--layout", "4xlstm", "--shared-experts", "1"], "--shared-experts does nothing here: it needs an MoE layer"),
    (["--model", "transformer", "--attention", "moa", "--num-heads", "8"], "it needs --attention mha or mae"),
])
def test_flags_that_do_nothing_for_the_chosen_model_are_refused(argv, fragment):
    with pytest.raises(UserError, match=re.escape(fragment)):
        parse(*argv)


def test_flags_that_apply_are_accepted():
    parse("--gate", "hierarchical", "--num-groups", "4", "--top-k-secondary", "2", "--dispatch", "capacity",
          "--capacity-factor", "1.5", "--softmax", "sampled", "--num-sampled", "100", "--w-importance", "0.2")
    parse("--model", "transformer", "--attention", "moa", "--moa-top-k", "2", "--moa-aux-weight", "0.1",
          "--num-layers", "3", "--ffn", "moe", "--num-experts", "8")
    parse("--layout", "lstm-ffn-lstm", "--ffn-layers", "2", "--expert-hidden", "64")
    parse("--gate", "aux_free", "--aux-free-score", "softmax", "--bias-update-rate", "0.01", "--seq-balance-weight",
          "0.001", "--shared-experts", "2", "--shared-expert-hidden", "32", "--shared-expert-gate")
    parse("--model", "transformer", "--ffn", "moe", "--shared-experts", "1", "--no-shared-expert-gate")


def test_the_llama_block_routes_as_mixtral_unless_told_and_the_default_block_keeps_its_gate():
    llama = parse("--model", "transformer", "--block", "llama", "--ffn", "moe")
    assert (llama.moe.router.gate, llama.moe.router.softmax_topk.renormalize) == ("softmax_topk", "full")
    assert llama.model.transformer.tie_embeddings is False and llama.train.init_from_hf is None
    default = parse("--model", "transformer", "--ffn", "moe")
    assert (default.model.transformer.block, default.moe.router.gate) == ("default", "noisy_topk")
    assert default.moe.router.softmax_topk.renormalize == "none"
    with pytest.raises(UserError, match="--moa-renormalize detached"):   # given: kept, and refused
        parse("--model", "transformer", "--block", "llama", "--ffn", "moe", "--moa-renormalize", "detached")
    dense = parse("--model", "transformer", "--block", "llama", "--tie-embeddings", "--rope-theta", "1e6")
    assert (dense.moe.router.gate, dense.model.transformer.rope_theta) == ("noisy_topk", 1e6)   # no MoE: untouched


def test_what_a_setting_needs_comes_from_its_sections_and_its_field():
    """inapplicable() reads the tree: a section's needs reach every setting in it (outermost first), and a
    setting that serves elsewhere too (`alone`) drops them."""
    from moe_scale.config import _LEAVES, RunConfig

    config = RunConfig()
    config.model.lstm.layout = "4xlstm"      # no MoE layer
    assert config.inapplicable("num_groups") == "it needs an MoE layer (--layout lstm-moe-lstm, or --model " \
                                                "transformer --ffn moe)"
    config.model.lstm.layout = "lstm-moe-lstm"
    assert config.inapplicable("num_groups") == "it needs --gate hierarchical"
    assert [n.flags for n in _LEAVES["num_groups"].needs] == [_LEAVES["num_experts"].needs[0].flags,
                                                             "--gate hierarchical"]
    config.model.kind, config.attention.kind = "transformer", "moa"    # MoA's router, no MoE FFN
    assert config.inapplicable("moa_aux_weight") is None
    assert config.inapplicable("num_experts") is not None
    assert all(leaf.needs for key, leaf in _LEAVES.items() if leaf.path[0] in ("moe", "attention"))


def test_gate_choice_is_validated_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["train", "--gate", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("gate", ["noisy_topk", "hierarchical", "batchwise", "softmax_topk", "aux_free"])
def test_every_gate_builds_and_routes(gate):
    import torch

    from moe_scale.config import RunConfig
    from moe_scale.models.lstm_lm import LSTMMoELM

    torch.manual_seed(0)
    model = LSTMMoELM(RunConfig.from_settings(d_model=8, expert_hidden=8, num_experts=8, top_k=2, gate=gate,
                                              num_groups=2),
                      vocab_size=20)
    x = torch.randint(0, 20, (4, 6))
    out = model(x, x)
    (out.nll_sum + out.aux_loss).backward()
    assert torch.isfinite(out.nll_sum) and model.moe.stats.importance_E.shape == (8,)
    assert model.moe.router.__class__.__name__.lower().startswith(gate.split("_")[0][:4])


def test_the_train_commands_of_the_mixtral_section_parse_as_shown():
    """docs/transformers.md's "Mixtral-style block and native export" commands (its $COMMON expanded, continued
    lines joined) are valid flags, and the measured runs differ only where the text says."""
    import shlex

    from tests.docs_code import code_blocks, section
    from tests.paths import REPO

    text = section(REPO / "docs" / "transformers.md", "Mixtral-style block and native export")
    shown = []
    for block in code_blocks(text, "bash"):
        joined = block.replace("\\\n", " ")
        variables = dict(re.findall(r'^(\w+)="(.*)"$', joined, flags=re.M))
        for line in joined.splitlines():
            if line.startswith("moe-scale train "):
                for name, value in variables.items():
                    line = line.replace("$" + name, value)
                shown.append(parse(*shlex.split(line)[2:]))
    assert len(shown) == 7
    qwen = shown[2]   # with gated shared experts: Qwen2-MoE's architecture
    assert (qwen.model.transformer.block, qwen.moe.experts.shared, qwen.moe.experts.shared_gate) == ("llama", 1, True)
    qwen3 = shown[3]   # with q/k norms: Qwen3-MoE's
    assert (qwen3.model.transformer.qk_norm, qwen3.model.transformer.rms_norm_eps) == (True, 1e-6)
    default, mixtral_router, llama = shown[4:]
    assert (default.model.transformer.block, llama.model.transformer.block) == ("default", "llama")
    assert (mixtral_router.moe.router.gate, llama.moe.router.gate) == ("softmax_topk", "softmax_topk")
    assert mixtral_router.moe.router.softmax_topk.renormalize == llama.moe.router.softmax_topk.renormalize == "full"
    assert 3 * llama.moe.experts.hidden == pytest.approx(2 * default.moe.experts.hidden, rel=0.05)   # equal params
    for config in shown[4:]:
        assert config.train.max_steps * config.train.batch_size * config.data.seq_len == 614_400
