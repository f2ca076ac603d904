"""The `moe-scale` command. Thin: parse flags into the typed config, call the library.

    moe-scale train [--config FILE] [--num-experts 16 --top-k 2 ...]
    moe-scale eval --run DIR [--split valid|test] [--data PATH] [--json]
    moe-scale flops --preset NAME [--json]        moe-scale plan --preset NAME --nodes N ...
    moe-scale prune-heads --run DIR [--data PATH] [--steps 10]

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
    if given.get("train.preset"):   # the preset first, so that flags given beside it override it
        from moe_scale.presets import apply_preset
        apply_preset(config, given.pop("train.preset"))
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

    flops = sub.add_parser("flops", help="parameters, ops/timestep and training FLOPs of a paper preset")
    flops.add_argument("--preset", help="preset name (see --list)")
    flops.add_argument("--list", action="store_true", help="list the presets")
    flops.add_argument("--softmax", choices=("full", "sampled"), help="count this softmax instead of the preset's")
    flops.add_argument("--softmax-samples", type=int, default=0, help="samples of a sampled softmax")
    flops.add_argument("--json", action="store_true", help="print one JSON object")
    from moe_scale.plan_command import add_plan_parser
    add_plan_parser(sub)
    prune = sub.add_parser("prune-heads", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           help="head importance and global head pruning of a transformer run (Michel et al. 2019)")
    prune.add_argument("--run", required=True, metavar="DIR", help="run directory written by `train`")
    prune.add_argument("--data", metavar="PATH", help="text for importance and perplexity (default: the run's "
                                                      "validation split)")
    prune.add_argument("--steps", type=int, default=10, help="pruning steps (the first prunes nothing)")
    prune.add_argument("--fraction-per-step", type=float, default=0.1, help="share of all heads removed per step")
    prune.add_argument("--max-batches", type=int, default=0, help="cap on batches of the data (0: all)")
    prune.add_argument("--abs-granularity", choices=("token", "example"), default="token",
                       help="|A·dL/dA| per token (released code) or per sequence (paper)")
    prune.add_argument("--recompute-importance", action="store_true", help="re-score the pruned model every step")
    prune.add_argument("--out", metavar="DIR", help="where pruning.{json,md,png} go (default: RUN/pruning)")
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
        elif args.command == "flops":
            from moe_scale.flops_command import run_flops
            print(run_flops(args.preset, args.json, args.softmax, args.softmax_samples, args.list))
        elif args.command == "plan":
            from moe_scale.plan_command import run_plan
            print(run_plan(args))
        elif args.command == "prune-heads":
            from moe_scale.attention.prune_schedule import prune_schedule

            prune_schedule(1, args.fraction_per_step, args.steps)   # flag errors before the slow imports
            from moe_scale.train.prune_command import format_report, run_prune_heads

            print(format_report(run_prune_heads(args.run, args.data, args.steps, args.fraction_per_step,
                                                args.max_batches, args.abs_granularity, args.recompute_importance,
                                                args.out)))
    except UserError as e:
        print(f"moe-scale: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
