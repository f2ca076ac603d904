"""The flags of the commands that open a trained run (eval, generate, export, prune-heads), declared once."""

from __future__ import annotations

import argparse


def add_run_flags(parser: argparse.ArgumentParser, verb: str) -> None:
    """--run DIR and --checkpoint TAG; `verb`: what the command does with the checkpoint ("evaluate", ...)."""
    parser.add_argument("--run", required=True, metavar="DIR", help="run directory written by `train`")
    parser.add_argument("--checkpoint", metavar="TAG", help=f"{verb} this checkpoint (e.g. step00000400) instead of "
                                                            f"the newest complete one")
