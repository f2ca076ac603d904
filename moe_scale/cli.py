"""The `moe-scale` command. Thin: parse flags into the typed config, call the library.

    moe-scale train [--config FILE] [--num-experts 16 --top-k 2 ...]
    moe-scale eval --run DIR [--split valid|test] [--data PATH] [--json]

Errors a user can cause print one line `moe-scale: error: ...` and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

from moe_scale.config import RunConfig
from moe_scale.distributed.launch import select_accelerator
from moe_scale.errors import UserError


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; defaults are suppressed so we can tell which flags were given."""
    hints_cache = {}
    for section in dataclasses.fields(RunConfig):
        section_cls = type(getattr(RunConfig(), section.name))
        hints = hints_cache.setdefault(section_cls, typing.get_type_hints(section_cls))
        group = parser.add_argument_group(f"{section.name} settings")
        for f in dataclasses.fields(section_cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            help_text = f"{f.metadata['help']} (default: {default})"
            kind = hints[f.name]
            if kind is bool:
                group.add_argument(flag, dest=f"{section.name}.{f.name}", action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
                continue
            base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
            group.add_argument(flag, dest=f"{section.name}.{f.name}", type=base, default=argparse.SUPPRESS,
                               choices=f.metadata.get("choices"), metavar=f.name.upper(), help=help_text)


def _config_from_args(args: argparse.Namespace) -> RunConfig:
    config = RunConfig.load(args.config) if args.config else RunConfig()
    given = {k: v for k, v in vars(args).items() if "." in k}
    if args.config:   # a reloaded run starts fresh unless told otherwise
        config.train.resume = config.train.overwrite = False
    for dotted, value in given.items():
        section, name = dotted.split(".")
        setattr(getattr(config, section), name, value)
    config.validate()
    return config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-scale", description=__doc__.split("\n")[0])
    # The deepspeed launcher puts --local_rank=N before the subcommand; LOCAL_RANK is what we use.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train an LSTM-MoE language model",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    train.add_argument("--config", metavar="FILE", help="reload a saved config.json (or a run directory); "
                                                        "flags given here override it")
    _add_config_flags(train)

    evaluate = sub.add_parser("eval", help="perplexity of a trained run on a split or on other text")
    evaluate.add_argument("--run", required=True, metavar="DIR", help="run directory written by `train`")
    evaluate.add_argument("--split", choices=("valid", "test"), default="valid")
    evaluate.add_argument("--data", metavar="PATH", help="evaluate on this text instead (file, dir or glob)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate.add_argument("--expert-stats", action="store_true", help="per MoE layer: load and importance per "
                          "expert, CV and max/mean load over the evaluated text")
    evaluate.add_argument("--top-tokens", type=int, default=0, metavar="N", help="per expert: the N positions with "
                          "the largest gate (with context) and the N words routed there most often")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    select_accelerator()   # before anything imports deepspeed
    try:
        if args.command == "train":
            config = _config_from_args(args)
            from moe_scale.train.trainer import run_training   # imports deepspeed: after flag errors

            run_training(config)
        elif args.command == "eval":
            from moe_scale.train.eval_command import run_eval

            from moe_scale.train.eval_command import format_eval

            result = run_eval(args.run, args.split, args.data, args.expert_stats, args.top_tokens)
            if result is not None:
                print(json.dumps(result) if args.json else format_eval(result))
    except UserError as e:
        print(f"moe-scale: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
