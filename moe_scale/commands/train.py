"""`moe-scale train`: one flag per field of the typed run configuration (config.py), then the training loop."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path

from moe_scale.commands.help_format import HelpFormatter, with_default
from moe_scale.config import RunConfig
from moe_scale.distributed.accelerate_env import ds_config_from_accelerate
from moe_scale.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train an LSTM-MoE or a transformer language model",
                       description="Train an LSTM-MoE (Shazeer et al. 2017) or a transformer LM (MHA, MoA or MAE "
                                   "attention; dense or MoE feed-forward) on the built-in corpus or your text.",
                       formatter_class=HelpFormatter)
    p.add_argument("--config", metavar="FILE", help="reload a saved config.json (or a run directory); "
                                                     "flags given here override it")
    _add_config_flags(p)
    p.set_defaults(run_command=run)


def _add_config_flags(parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = (),
                      unlisted: tuple[str, ...] = ()) -> None:
    """One flag per setting of the config tree; defaults are suppressed so we can tell which flags were given.
    `leave_out`: sections without flags (a command that makes no run leaves out "run"); `unlisted`: keys still
    parsed (to be refused with advice) but not shown in --help."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, leaf in RunConfig.leaves().items():
        if leaf.section in leave_out and key not in unlisted:
            continue
        if leaf.section not in groups:
            groups[leaf.section] = parser.add_argument_group(f"{leaf.section} settings")
        group = groups[leaf.section]
        choices = leaf.field.metadata.get("choices")
        help_text = argparse.SUPPRESS if key in unlisted else with_default(
            leaf.field.metadata["help"] + (f" [{', '.join(choices)}]" if choices else ""), leaf.field.default)
        if leaf.type is bool:
            group.add_argument(leaf.flag, dest=_DEST + key, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        base = next((a for a in typing.get_args(leaf.type) if a is not type(None)), leaf.type)
        group.add_argument(leaf.flag, dest=_DEST + key, type=base, default=argparse.SUPPRESS, choices=choices,
                           metavar="{" + ",".join(choices) + "}" if choices else key.upper(), help=help_text)


_DEST = "setting:"


# What a resumed run may change: how long it trains and how often it reports and saves. Everything else is the
# run's own (its config.json): a resume that silently trained on other data or with another learning rate would
# report numbers of a run that never happened.
RESUMABLE_CHANGES = ("max_steps", "token_budget", "log_interval", "eval_interval", "eval_max_batches",
                     "checkpoint_interval", "keep_checkpoints", "resume_from", "ep_size", "vocab_exchange",
                     "accept_changed_data")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    given = {k[len(_DEST):]: v for k, v in vars(args).items() if k.startswith(_DEST)}
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
    _llama_router(config, given)
    config.parallel.ds_config = ds_config_from_accelerate(config.parallel.ds_config)
    for key in given:
        reason = config.inapplicable(key)
        if reason:
            raise UserError(f"{RunConfig.leaves()[key].flag} does nothing here: {reason}; drop the flag or add "
                            f"what it needs")
    config.validate()
    return config


def _llama_router(config: RunConfig, given: dict) -> None:
    """--block llama with an MoE FFN routes as Mixtral: --gate softmax_topk --moa-renormalize full unless given
    (config.validate() refuses other gates for the llama block)."""
    if config.model.kind == "transformer" and config.model.transformer.block == "llama" \
            and config.model.transformer.ffn == "moe":
        if "gate" not in given:
            config.moe.router.gate = "softmax_topk"
        if "moa_renormalize" not in given:
            config.moe.router.softmax_topk.renormalize = "full"


def _resumed_config(args: argparse.Namespace, given: dict) -> RunConfig:
    """--resume: the run's saved config.json, with only RESUMABLE_CHANGES taken from the flags."""
    out = given.get("out", RunConfig().run.out)
    if given.get("overwrite"):
        raise UserError("--resume and --overwrite contradict each other; pass one of them")
    if args.config:
        raise UserError("--resume continues the run in --out with its own config.json; drop --config")
    saved_path = Path(out) / "config.json"
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


def run(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    from moe_scale.train.loop import run_training   # imports deepspeed: after flag errors

    run_training(config)
