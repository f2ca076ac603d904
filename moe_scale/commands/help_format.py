"""How every `moe-scale` help page shows an option's default: once, and only where there is one to show.

argparse's ArgumentDefaultsHelpFormatter appends "(default: X)" to every option, also where the help text names
its default already ("(default: the newest complete one) (default: None)"), to required options and to flags
("(default: False)"). `train`'s flags are suppressed-default flags that write their default into the help text
themselves (config fields, commands/train.py), through `with_default`.
"""

from __future__ import annotations

import argparse


def names_default(help_text: str) -> bool:
    return "(default" in help_text or "%(default)" in help_text


def with_default(help_text: str, default) -> str:
    """`help_text` and " (default: X)", unless it names its default already or there is none to name (None)."""
    if default is None or names_default(help_text):
        return help_text
    return f"{help_text} (default: {default})"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, less the defaults that say nothing or say it a second time."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        plain_flag = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)   # store_true
        if (action.required or plain_flag or not action.option_strings or action.default in (None, argparse.SUPPRESS)
                or names_default(help_text)):
            return help_text
        return help_text + " (default: %(default)s)"
