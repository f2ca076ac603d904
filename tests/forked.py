"""Fresh processes without the import cost: children forked from one warm server per test session.

Starting `python -m moe_scale` costs about 4 s on 2 CPU cores, nearly all of it importing torch, DeepSpeed and
moe_scale; a tiny training run takes about 2 s after that. multiprocessing's forkserver imports them once
(tests/warm_imports.py, preloaded into a single-threaded server that never runs a torch op, so no thread pool is
forked) and forks each child from it. A child is still a process of its own: its own pid, environment, working
directory, RNG, signal handlers, process group and exit status (or death by a signal), with stdout and stderr
at the file-descriptor level in files of its own, so a log line written by a library is captured as a real
process's would be. It starts in milliseconds.

    child = start(moe_scale.cli.main, ["train", ...], cwd=run_dir, env=env)   # entry(argv) -> exit status
    child.wait(timeout=600)   # child.returncode, child.stdout, child.stderr

`entry` must be a module-level function (the child imports it by name).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

PRELOAD = "tests.warm_imports"


def context():
    """The forkserver context; its server (started on first use) preloads PRELOAD."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    return ctx


def _child_main(entry: Callable[[list[str]], int], argv: list[str], cwd: str, env: dict[str, str],
                out: str, err: str) -> None:
    """In the child: its environment and working directory, fds 1 and 2 to files, then entry(argv)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    if env.get("OMP_NUM_THREADS", "").isdigit():   # what torch reads at start-up in a new interpreter
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.exit(entry(argv))


class Child:
    """One started child: pid, send_signal, kill, wait; after wait: returncode, stdout, stderr."""

    def __init__(self, entry: Callable[[list[str]], int], argv: list[str], cwd: Path | str,
                 env: dict[str, str]):
        self._files = Path(tempfile.mkdtemp(prefix="forked-"))
        self.args = [getattr(entry, "__module__", "?") + "." + getattr(entry, "__name__", "?"), *argv]
        self.returncode: int | None = None
        self.stdout = self.stderr = ""
        self._process = context().Process(target=_child_main, args=(entry, list(argv), str(cwd), dict(env),
                                                                     str(self._files / "out"),
                                                                     str(self._files / "err")))
        self._process.start()
        self.pid: int = self._process.pid
        _LIVE.add(self)

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._finish()
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """The exit status (negative: killed by that signal); on timeout the child is killed and TimeoutError
        raised with its output so far."""
        if self.returncode is not None:
            return self.returncode
        self._process.join(timeout)
        if self._process.is_alive():
            self.kill()
            self._process.join()
            self._finish()
            raise TimeoutError(f"{' '.join(self.args)} did not finish in {timeout} s; stderr:\n{self.stderr[-3000:]}")
        self._finish()
        return self.returncode

    def _finish(self) -> None:
        if self.returncode is not None:
            return
        self._process.join()
        self.returncode = self._process.exitcode
        self.stdout = _read(self._files / "out")
        self.stderr = _read(self._files / "err")
        shutil.rmtree(self._files, ignore_errors=True)
        self._process.close()
        _LIVE.discard(self)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def start(entry: Callable[[list[str]], int], argv: list[str], cwd: Path | str, env: dict[str, str]) -> Child:
    return Child(entry, argv, cwd, env)


def wait_all(children: list[Child], timeout: float) -> None:
    """Wait for every child, as a launcher does: once one fails, the others are killed (they would wait in a
    collective for it); past the timeout, all are killed and TimeoutError raised."""
    deadline = time.monotonic() + timeout
    while None in (statuses := [c.poll() for c in children]):
        if any(status not in (None, 0) for status in statuses) or time.monotonic() > deadline:
            timed_out = time.monotonic() > deadline
            for c in children:
                c.kill()
            for c in children:
                c.wait()
            if timed_out:
                raise TimeoutError(f"{' '.join(children[0].args)}: ranks did not finish in {timeout} s")
            return
        time.sleep(0.02)


_LIVE: set[Child] = set()
_most_ranks = 1


def note_ranks(count: int) -> None:
    """Record that `count` processes were started to run together (a world of that many ranks)."""
    global _most_ranks
    _most_ranks = max(_most_ranks, count)


def most_ranks_since_asked() -> int:
    """The largest world started since the last call (1: none of several processes)."""
    global _most_ranks
    count, _most_ranks = _most_ranks, 1
    return count


def kill_all() -> None:
    """Kill every child still running (a test that failed half-way must not leave training processes behind)."""
    for child in list(_LIVE):
        child.kill()
        child.wait()
