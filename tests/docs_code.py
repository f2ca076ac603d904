"""The commands and code the documentation shows, read from the markdown (so a test breaks when the docs change)
and run as a user would run them."""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import re
from pathlib import Path

import pytest


def section(markdown: Path, heading: str) -> str:
    """The text under `heading` (a `#`... line) up to the next heading of the same or a higher level."""
    lines = markdown.read_text(encoding="utf-8").splitlines()
    titles = [i for i, line in enumerate(lines) if re.fullmatch(r"#+ " + re.escape(heading), line)]
    assert len(titles) == 1, f"{markdown}: {len(titles)} headings '{heading}'"
    start = titles[0]
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    end = next((i for i in range(start + 1, len(lines))
                if re.match(r"#{1,%d} " % level, lines[i]) and not _in_fence(lines, i)), len(lines))
    return "\n".join(lines[start + 1:end])


def _in_fence(lines: list[str], index: int) -> bool:
    return sum(1 for line in lines[:index] if line.startswith("```")) % 2 == 1


def code_blocks(markdown: str, language: str) -> list[str]:
    """The fenced blocks of `language` (```python ... ```), in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", markdown, flags=re.S | re.M)


def commands(block: str, program: str) -> list[list[str]]:
    """The lines of a shell block that run `program`, split as the shell would (comments dropped)."""
    import shlex

    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith(program + " ")]


def _prompted(*args, **kwargs):
    pytest.fail(f"the documented code stopped at an interactive prompt: {args[0] if args else ''!r}")


def run_python(code: str, cwd: Path) -> str:
    """`code` run in this process with `cwd` as the working directory; returns what it printed. A prompt for
    input (transformers' `[y/N]` before remote code) fails the test: `input` raises past any `except Exception`."""
    printed = io.StringIO()
    here = os.getcwd()
    reading = builtins.input
    builtins.input = _prompted
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "<documented code>", "exec"), {"__name__": "__documented__"})
    finally:
        builtins.input = reading
        os.chdir(here)
    return printed.getvalue()
