"""Argument parsing shared by the scripts in tools/: one-line errors (exit 2) and number checks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _bounded(convert, minimum, what: str, strict: bool = False):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value > minimum if strict else value >= minimum):   # written so that NaN fails
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


positive_int = _bounded(int, 1, "a positive integer")
non_negative_int = _bounded(int, 0, "an integer >= 0")
positive_float = _bounded(float, 0.0, "a positive number", strict=True)
non_negative_float = _bounded(float, 0.0, "a number >= 0")


def positive_int_list(text: str) -> list[int]:
    """'8,64,256' -> [8, 64, 256]; empty items and non-positive values are errors."""
    items = [t.strip() for t in text.split(",")]
    if any(not t for t in items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive integers, got {text!r}")
    return [positive_int(t) for t in items]


def check_out_file(parser: argparse.ArgumentParser, path: Path | None) -> None:
    """--out must name a file in an existing directory: checked before any work, so nothing is half-written."""
    if path is None:
        return
    if path.is_dir():
        parser.error(f"--out {path} is a directory; give a file path")
    if not path.parent.is_dir():
        parser.error(f"--out {path}: directory {path.parent} does not exist (create it first)")
