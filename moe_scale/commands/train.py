"""`moe-scale train`: one flag per field of the typed run configuration (config.py), then the training loop."""

from __future__ import annotations

import argparse
import dataclasses
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
    """One flag per config field; defaults are suppressed so we can tell which flags were given."""
    hints_cache = {}
    for section in dataclasses.fields(RunConfig):
        section_cls = type(getattr(RunConfig(), section.name))
        hints = hints_cache.setdefault(section_cls, typing.get_type_hints(section_cls))
        group = parser.add_argument_group(f"{section.name} settings")
        for f in dataclasses.fields(section_cls):
            flag = "--" + f.name.replace("_", "-")
            choices = f.metadata.get("choices")
            help_text = f"{f.metadata['help']}" + (f" ({', '.join(choices)})" if choices else "") + \
                f" (default: {f.default})"
            kind = hints[f.name]
            if kind is bool:
                group.add_argument(flag, dest=f"{section.name}.{f.name}", action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
                continue
            base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
            group.add_argument(flag, dest=f"{section.name}.{f.name}", type=base, default=argparse.SUPPRESS,
                               choices=choices, metavar="{" + ",".join(choices) + "}" if choices else
                               f.name.upper(), help=help_text)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    config = RunConfig.load(args.config) if args.config else RunConfig()
    given = {k: v for k, v in vars(args).items() if "." in k}
    if args.config:   # a reloaded run starts fresh unless told otherwise
        config.train.resume = config.train.overwrite = False
    if given.get("train.preset"):   # the preset first, so that flags given beside it override it
        from moe_scale.presets import apply_preset
        apply_preset(config, given.pop("train.preset"))
    for dotted, value in given.items():
        section, name = dotted.split(".")
        setattr(getattr(config, section), name, value)
    config.validate()
    return config


def run(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    from moe_scale.train.loop import run_training   # imports deepspeed: after flag errors

    run_training(config)
