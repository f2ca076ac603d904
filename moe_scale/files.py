"""Files a run writes: whole or not at all, and readable by whoever may read the directory.

A write goes to a temporary name beside its target (`.NAME.tmp-XXXX`) and is renamed over it, so a reader (or a
run killed mid-write) sees the old file or the new one, never half of one. Temporary files are created
owner-only; the finished file gets the permissions any new file would (0666 less the umask: group-readable on
a shared cluster account, as the checkpoints DeepSpeed writes are).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

_TMP = ".tmp-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The permissions open() gives a new file here: 0666 less the umask (for files a library writes owner-only,
    e.g. safetensors' save_file)."""
    return 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write the whole file to; renamed over `path` when the block ends, removed
    if it raises (an error, or a signal's Interrupted)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{_TMP}", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def save_figure_atomic(figure, path: Path, **savefig) -> Path:
    """A matplotlib figure at `path` (the format its suffix names; PNG without one), whole or not at all."""
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format=Path(path).suffix[1:].lower() or "png", **savefig)
    return path


def write_json_atomic(path: Path, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def is_partial_write(name: str) -> bool:
    """What a write killed before its rename leaves behind."""
    return name.startswith(".") and _TMP in name


_SPECIAL = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"))


def special_kind(path: Path) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a directory ("a named pipe (FIFO)", ...)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((name for test, name in _SPECIAL if test(mode)), None)


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    return True
