"""SIGINT (Ctrl-C) and SIGTERM end any command with one line and the conventional exit status 128 + the signal's
number (130, 143), leaving nothing half-written.

While a command runs, either signal raises `Interrupted` where the program is, so the code unwinds as it does for
an error: every write in progress removes its temporary file or directory (moe_scale/files.py, the export's and the
checkpoint's partial directories) and the run directory's lock is released. `Interrupted` is a BaseException, like
KeyboardInterrupt, so no `except Exception` swallows it. Training installs its own handlers over these for its
steps (train/preemption.py: the first signal finishes the step and writes a checkpoint; a second Ctrl-C raises
`Interrupted` at once).
"""

from __future__ import annotations

import contextlib
import signal
import threading

ENDING = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A signal that ends the command now."""

    def __init__(self, number: int):
        super().__init__(signal.Signals(number).name)
        self.number = int(number)

    @property
    def name(self) -> str:
        return signal.Signals(self.number).name

    @property
    def exit_status(self) -> int:
        return 128 + self.number


def _raise(number, frame) -> None:
    raise Interrupted(number)


@contextlib.contextmanager
def signals_end_the_command():
    """Within: SIGINT and SIGTERM raise Interrupted (the main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, _raise) for number in ENDING}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def interrupted_line(e: BaseException) -> tuple[str, int]:
    """(the one line, the exit status) for an Interrupted or a KeyboardInterrupt."""
    number = e.number if isinstance(e, Interrupted) else int(signal.SIGINT)
    name = signal.Signals(number).name
    return f"moe-scale: stopped by {name} before finishing; nothing half-written was left", 128 + number
