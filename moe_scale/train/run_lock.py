"""One run per directory: a lock file naming the writer's host and process.

Created with O_EXCL, so two starts cannot both take it. A lock whose process is gone (killed with -9, a node
that rebooted into the same name) is stale: on its own host we can tell (no such PID, or a PID reused by a
process that started later) and take it over with a warning; a lock from another host cannot be checked from
here and is treated as live, with the fix spelled out.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from moe_scale.errors import UserError
from moe_scale.files import process_alive
from moe_scale.run_files import RunFiles

LOCK_NAME = RunFiles.LOCK


def _process_start(pid: int) -> str | None:
    """The kernel's start time of a process (field 22 of /proc/PID/stat), or None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _read(path: Path) -> dict | None:
    try:
        owner = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return {}   # unreadable or half-written: its writer may still be starting
    return owner if isinstance(owner, dict) else {}


def _is_stale(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    pid = owner["pid"]
    if not process_alive(pid):
        return True
    return owner.get("start") is not None and _process_start(pid) != owner["start"]


def _describe(owner: dict, path: Path) -> str:
    if not owner:
        return f"{path} exists but cannot be read; delete it if no run is writing there"
    return (f"process {owner.get('pid')} on {owner.get('host')}, since {owner.get('since', '?')}; if that run is "
            f"gone, delete {path}")


def live_owner(run: Path) -> str | None:
    """Who holds the run's lock, if anyone live does (read only)."""
    path = run / LOCK_NAME
    owner = _read(path)
    if owner is None or _is_stale(owner):
        return None
    return _describe(owner, path)


class RunLock:
    def __init__(self, path: Path, owner: dict):
        self.path, self.owner = path, owner

    @classmethod
    def acquire(cls, run: Path) -> "RunLock":
        path = run / LOCK_NAME
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid()),
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = _read(path)
                if owner is None:
                    continue   # released in between: try again
                if not _is_stale(owner):
                    raise UserError(f"--out {run} is in use by a live run ({_describe(owner, path)}); wait for it "
                                    f"to end or choose another --out") from None
                print(f"moe-scale: warning: taking over the stale lock of process {owner['pid']} on "
                      f"{owner['host']} (no longer running) in {run}", file=sys.stderr, flush=True)
                path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return cls(path, me)
        raise UserError(f"--out {run}: could not take {path} (another run is starting there); try again")

    def release(self) -> None:
        """Removes the lock if it is still ours."""
        if _read(self.path) == self.owner:
            self.path.unlink(missing_ok=True)
