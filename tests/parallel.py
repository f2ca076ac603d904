"""The suite on several pytest-xdist workers (`-n auto --dist load` in pyproject.toml): how many, what each worker
runs with, which tests must share one, and in what order they start.

- Workers: one per usable core, at most MAX_WORKERS (each holds its own forkserver, rank pools and session runs).
  `-n 0` runs everything in this process.
- Each worker's torch uses one thread, as each command a test starts does (tests/cli_runs.py): two threads per
  worker on a 2-core machine wait for each other at every operation.
- A test file that defines a module-, class- or package-scoped fixture (a run trained once for the file, a SLURM
  cluster) runs whole on one worker: a second worker would train the run again, or start a second cluster beside the
  first. `FileGroups` is xdist's scope scheduler with that rule (every other test is a unit of its own); a worker
  refuses to start if a test uses such a fixture from a file the rule missed.
- The heaviest tests start first (slow, then multiprocess, in file order), so that the many short ones fill the end
  of the run on both workers instead of one long test running alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

MAX_WORKERS = 4
_SHARED_SCOPES = ("module", "class", "package")
_SHARED_FIXTURE = re.compile(r"""scope\s*=\s*["'](?:module|class|package)["']""")


def pytest_xdist_auto_num_workers(config) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def grouped_files(root: Path) -> set[str]:
    """The test files (relative to the repository, as in node ids) that define a fixture shared by their tests."""
    return {path.relative_to(root).as_posix() for path in (root / "tests").rglob("test_*.py")
            if _SHARED_FIXTURE.search(path.read_text(encoding="utf-8"))}


def unit_of_work(nodeid: str, grouped: set[str]) -> str:
    """What xdist hands a worker at once: a grouped file whole; any other test alone."""
    file = nodeid.split("::", 1)[0]
    return file if file in grouped else nodeid


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        grouped = grouped_files(config.rootpath)

        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid, self.grouped)

    return FileGroups(config, log)


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config) -> None:
    # In-process commands keep the count they are given, as the commands a test starts do (tests/cli_runs.py):
    # none samples the machine's busy cores (moe_scale/distributed/threads.py).
    os.environ["OMP_NUM_THREADS"] = "1"
    if _is_worker(config):
        import torch

        torch.set_num_threads(1)


def _weight(item) -> int:
    """0 for the heaviest (slow), 1 for several ranks, 2 for the rest."""
    if item.get_closest_marker("slow") is not None:
        return 0
    return 1 if item.get_closest_marker("multiprocess") is not None else 2


def _uses_a_shared_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(fixturedef.scope in _SHARED_SCOPES
                                    for defs in info.name2fixturedefs.values() for fixturedef in defs)


def pytest_collection_modifyitems(config, items) -> None:
    if not _is_worker(config):
        return
    grouped = grouped_files(config.rootpath)
    missed = sorted({item.nodeid.split("::", 1)[0] for item in items if _uses_a_shared_fixture(item)} - grouped)
    if missed:
        raise pytest.UsageError(f"{missed[0]} uses a module-scoped fixture that tests/parallel.py's grouped_files "
                                "does not see (defined elsewhere): define it in that file, or teach grouped_files")
    weights: dict[str, int] = {}
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        if file in grouped:
            weights[file] = min(weights.get(file, 2), _weight(item))

    def weight(item) -> int:   # a grouped file is as heavy as its heaviest test
        return weights.get(item.nodeid.split("::", 1)[0], _weight(item))

    items.sort(key=weight)   # stable: file order holds within a weight
