"""The run configuration's flags, one per field of the typed config tree (config.py): declared once for every
command that takes them (train, plan), and the config they describe."""

from __future__ import annotations

import argparse
import typing

from moe_scale.commands.help_format import with_default
from moe_scale.config import RunConfig
from moe_scale.distributed.accelerate_env import ds_config_from_accelerate
from moe_scale.errors import UserError
from moe_scale.run_files import RunFiles


# --help's groups, in this order: what the model is, its experts, what it reads, how it is spread, the run itself
# (a section not named here would come last). Within a group the flags most runs set come first (FIRST), then the
# rest in the config tree's order.
SECTION_ORDER = ("model", "moe", "attention", "softmax", "data", "train", "parallel", "run")
FIRST = {"model": ("model", "d_model", "layout", "num_layers", "ffn", "block"),
         "moe": ("num_experts", "top_k", "expert_hidden", "gate", "shared_experts", "dispatch"),
         "attention": ("attention", "num_heads", "head_dim"),
         "data": ("data", "tokenizer", "vocab_size", "seq_len", "valid_data", "test_data"),
         "train": ("batch_size", "max_steps", "lr", "preset", "seed"),
         "parallel": ("ep_size", "ds_config"),
         "run": ("out", "resume", "overwrite")}


def help_order() -> list[str]:
    """The config keys in --help's order: by SECTION_ORDER, and within a section FIRST's keys first."""
    leaves = RunConfig.leaves()
    sections = sorted({leaf.section for leaf in leaves.values()},
                      key=lambda s: SECTION_ORDER.index(s) if s in SECTION_ORDER else len(SECTION_ORDER))
    order = []
    for section in sections:
        keys = [key for key, leaf in leaves.items() if leaf.section == section]
        first = [key for key in FIRST.get(section, ()) if key in keys]
        order += first + [key for key in keys if key not in first]
    return order


def add_config_flags(parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = (),
                      unlisted: tuple[str, ...] = ()) -> None:
    """One flag per setting of the config tree; defaults are suppressed so we can tell which flags were given.
    `leave_out`: sections without flags (a command that makes no run leaves out "run"); `unlisted`: keys still
    parsed (to be refused with advice) but not shown in --help. The groups and flags come in `help_order()`."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    leaves = RunConfig.leaves()
    for key in help_order():
        leaf = leaves[key]
        if leaf.section in leave_out and key not in unlisted:
            continue
        if leaf.section not in groups:
            groups[leaf.section] = parser.add_argument_group(f"{leaf.section} settings")
        group = groups[leaf.section]
        choices = leaf.field.metadata.get("choices")
        help_text = argparse.SUPPRESS if key in unlisted else with_default(
            leaf.field.metadata["help"] + (f" [{', '.join(choices)}]" if choices else ""), leaf.field.default)
        if leaf.type is bool:
            group.add_argument(leaf.flag, dest=DEST + key, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        base = next((a for a in typing.get_args(leaf.type) if a is not type(None)), leaf.type)
        group.add_argument(leaf.flag, dest=DEST + key, type=base, default=argparse.SUPPRESS, choices=choices,
                           metavar="{" + ",".join(choices) + "}" if choices else key.upper(), help=help_text)


DEST = "setting:"


# What a resumed run may change: how long it trains and how often it reports and saves. Everything else is the
# run's own (its config.json): a resume that silently trained on other data or with another learning rate would
# report numbers of a run that never happened.
RESUMABLE_CHANGES = ("max_steps", "token_budget", "log_interval", "eval_interval", "eval_max_batches",
                     "checkpoint_interval", "keep_checkpoints", "resume_from", "ep_size", "vocab_exchange",
                     "accept_changed_data", "record_routes", "replay_routes", "a2a_chunks", "etp_size")


def given_settings(args: argparse.Namespace) -> dict:
    """{key: value} of the settings given as flags (the parser suppresses the others' defaults)."""
    return {k[len(DEST):]: v for k, v in vars(args).items() if k.startswith(DEST)}


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run's config: defaults, or --config FILE, or --resume's saved one, with the flags given applied."""
    given = given_settings(args)
    if given.get("resume"):
        return _resumed_config(args, given)
    config = RunConfig.load(args.config) if args.config else RunConfig()
    if args.config:   # a reloaded run starts fresh unless told otherwise
        config.run.resume = config.run.overwrite = False
    if given.get("preset"):   # the preset first, so that flags given beside it override it
        from moe_scale.accounting.presets import apply_preset
        apply_preset(config, given.pop("preset"))
    for key, value in given.items():
        config.set(key, value)
    config.resolve_implied_defaults(set(given))
    config.parallel.ds_config = ds_config_from_accelerate(config.parallel.ds_config)
    for key in given:
        reason = config.inapplicable(key)
        if reason:
            raise UserError(f"{RunConfig.leaves()[key].flag} does nothing here: {reason}; drop the flag or add "
                            f"what it needs")
    config.validate()
    return config


def _resumed_config(args: argparse.Namespace, given: dict) -> RunConfig:
    """--resume: the run's saved config.json, with only RESUMABLE_CHANGES taken from the flags."""
    out = given.get("out", RunConfig().run.out)
    if given.get("overwrite"):
        raise UserError("--resume and --overwrite contradict each other; pass one of them")
    if args.config:
        raise UserError("--resume continues the run in --out with its own config.json; drop --config")
    saved_path = RunFiles(out).config
    if not saved_path.is_file():
        raise UserError(f"--resume: {saved_path} is missing, so there is no run to resume in --out {out}; start "
                        f"without --resume")
    config = RunConfig.load(saved_path)
    config.run.accept_changed_data = False   # an earlier resume's consent is not this one's
    for key, value in given.items():
        if key in RESUMABLE_CHANGES or key in ("resume", "out"):
            config.set(key, value)
        elif config.get(key) != value:
            flag = RunConfig.leaves()[key].flag
            raise UserError(f"{flag} {value}: this run was trained with {flag} {config.get(key)}, and a resumed run "
                            f"keeps its settings (it may change only "
                            f"{', '.join(RunConfig.leaves()[k].flag for k in RESUMABLE_CHANGES)}); start a new run "
                            f"with --out elsewhere to change it")
    if config.parallel.ds_config != ds_config_from_accelerate(config.parallel.ds_config):
        raise UserError(f"this run was trained with --ds-config {config.parallel.ds_config}, and accelerate's "
                        f"deepspeed_config_file is another; resume with the run's own DeepSpeed JSON")
    config.run.resume, config.run.overwrite = True, False
    config.validate()
    return config
