"""What a command prints besides its own output: library notices that tell a moe_scale user nothing are dropped
where they arise, each by its own text (never a whole logger, stream or warning category), so every error and
every other warning still shows.

- DeepSpeed's line that its shared-memory communication op was loaded, printed on stdout by every process at
  every start: `deepspeed_stdout_to_stderr()` moves DeepSpeed's stdout to stderr while it initialises (stdout is
  the command's output), without that line;
- the FutureWarning torch gives DeepSpeed's ZeRO 1/2 for a deprecated all-gather: `drop_library_notices()`,
  called once by cli.main.

The texts are DeepSpeed's and live in moe_scale/deepspeed_internals.py. The deepspeed launcher's own lines (its
command lines, "Setting CUDA_VISIBLE_DEVICES=0,1" on CPU too) are printed before moe_scale runs: the documented
commands pass it `--log_level warning` (docs/clusters.md#console-output).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import warnings
from typing import Iterator, TextIO

from moe_scale.deepspeed_internals import DEPRECATED_GATHER_WARNING, OP_LOADED_LINE


class WithoutLines(io.TextIOBase):
    """A text stream writing whole lines to `target`, less those `drop` matches in full. A line is passed on when
    its newline arrives; `finish()` passes on a last line without one."""

    def __init__(self, target: TextIO, drop: re.Pattern):
        self.target, self.drop, self.pending = target, drop, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not self.drop.fullmatch(line):
                self.target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def finish(self) -> None:
        if self.pending and not self.drop.fullmatch(self.pending):
            self.target.write(self.pending)
        self.pending = ""
        self.flush()


@contextlib.contextmanager
def deepspeed_stdout_to_stderr() -> Iterator[None]:
    """Inside: what is printed goes to stderr, less DeepSpeed's line that its communication op was loaded."""
    stream = WithoutLines(sys.stderr, OP_LOADED_LINE)
    try:
        with contextlib.redirect_stdout(stream):
            yield
    finally:
        stream.finish()


def drop_library_notices() -> None:
    """Process-wide warning filters for the notices above (idempotent)."""
    warnings.filterwarnings("ignore", message=DEPRECATED_GATHER_WARNING, category=FutureWarning)
