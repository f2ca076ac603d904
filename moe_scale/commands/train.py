"""`moe-scale train`: one flag per field of the typed run configuration (config.py), then the training loop."""

from __future__ import annotations

import argparse

from moe_scale.commands.config_flags import add_config_flags, config_from_args
from moe_scale.commands.help_format import HelpFormatter


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train an LSTM-MoE or a transformer language model",
                       description="Train an LSTM-MoE (Shazeer et al. 2017) or a transformer LM (MHA, MoA or MAE "
                                   "attention; dense or MoE feed-forward) on the built-in corpus or your text.",
                       formatter_class=HelpFormatter)
    p.add_argument("--config", metavar="FILE", help="reload a saved config.json (or a run directory); "
                                                     "flags given here override it")
    add_config_flags(p)
    p.set_defaults(run_command=run)


def run(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    from moe_scale.train.loop import run_training   # imports deepspeed: after flag errors

    run_training(config)
