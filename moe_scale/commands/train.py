"""`moe-scale train`: one flag per field of the typed run configuration (config.py), then the training loop."""

from __future__ import annotations

import argparse
import typing

from moe_scale.config import RunConfig


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train an LSTM-MoE or a transformer language model",
                       description="Train an LSTM-MoE (Shazeer et al. 2017) or a transformer LM (MHA, MoA or MAE "
                                   "attention; dense or MoE feed-forward) on the built-in corpus or your text.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="reload a saved config.json (or a run directory); "
                                                     "flags given here override it")
    _add_config_flags(p)
    p.set_defaults(run_command=run)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting of the config tree; defaults are suppressed so we can tell which flags were given."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, leaf in RunConfig.leaves().items():
        if leaf.section not in groups:
            groups[leaf.section] = parser.add_argument_group(f"{leaf.section} settings")
        group = groups[leaf.section]
        choices = leaf.field.metadata.get("choices")
        help_text = leaf.field.metadata["help"] + (f" ({', '.join(choices)})" if choices else "") + \
            f" (default: {leaf.field.default})"
        if leaf.type is bool:
            group.add_argument(leaf.flag, dest=_DEST + key, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        base = next((a for a in typing.get_args(leaf.type) if a is not type(None)), leaf.type)
        group.add_argument(leaf.flag, dest=_DEST + key, type=base, default=argparse.SUPPRESS, choices=choices,
                           metavar="{" + ",".join(choices) + "}" if choices else key.upper(), help=help_text)


_DEST = "setting:"


def config_from_args(args: argparse.Namespace) -> RunConfig:
    config = RunConfig.load(args.config) if args.config else RunConfig()
    given = {k[len(_DEST):]: v for k, v in vars(args).items() if k.startswith(_DEST)}
    if args.config:   # a reloaded run starts fresh unless told otherwise
        config.run.resume = config.run.overwrite = False
    if given.get("preset"):   # the preset first, so that flags given beside it override it
        from moe_scale.accounting.presets import apply_preset
        apply_preset(config, given.pop("preset"))
    for key, value in given.items():
        config.set(key, value)
    config.validate()
    return config


def run(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    from moe_scale.train.loop import run_training   # imports deepspeed: after flag errors

    run_training(config)
