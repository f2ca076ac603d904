"""The suite on several pytest-xdist workers (`-n auto --dist loadgroup` in pyproject.toml): how many, what each
worker runs with, and which tests must share one.

- Workers: one per usable core, at most MAX_WORKERS (each holds its own forkserver, rank pools and session runs).
  `-n 0` runs everything in this process, as before.
- Each worker's torch uses one thread, as each command a test starts does (tests/cli_runs.py): two threads per
  worker on a 2-core machine wait for each other at every operation.
- Tests that share a module-scoped fixture (a run trained once for the file, a SLURM cluster) run on one worker, in
  one group: a second worker would train the run again, or start a second cluster beside the first.
- The heaviest tests start first (slow, then multiprocess, in file order), so that the many short ones fill the end
  of the run on both workers instead of one long test running alone.
"""

from __future__ import annotations

import os

import pytest

MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config) -> None:
    if _is_worker(config):
        import torch

        torch.set_num_threads(1)


def _weight(item) -> int:
    """0 for the heaviest (slow), 1 for several ranks, 2 for the rest."""
    if item.get_closest_marker("slow") is not None:
        return 0
    return 1 if item.get_closest_marker("multiprocess") is not None else 2


def _shared_module_fixture(item) -> str | None:
    """The file of a module- (or class-, package-) scoped fixture this test uses, if any."""
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for fixturedef in defs:
            if fixturedef.scope in ("module", "class", "package"):
                return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items) -> None:
    if not _is_worker(config):
        return
    groups: dict[str, int] = {}
    for item in items:
        group = _shared_module_fixture(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            groups[group] = min(groups.get(group, 2), _weight(item))
    # A group is as heavy as its heaviest test; sorted() is stable, so file order holds within a weight.
    items.sort(key=lambda item: groups.get(_shared_module_fixture(item) or "", _weight(item)))
