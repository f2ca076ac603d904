"""Torch threads per process: each process of a launch takes its share of the cores, not all of them.

torch's thread pool takes every core in every process. The deepspeed launcher starts its ranks with nothing set,
so 2 ranks on 2 cores ran 4 threads on 2 cores: up to 4 times slower than one thread each, what torchrun and
`accelerate launch` set through OMP_NUM_THREADS (tools/bench_threads.py, docs/clusters.md#threads).

Unless OMP_NUM_THREADS is set (by the user, or by a launcher: torchrun, accelerate, `deepspeed
--bind_cores_to_rank`), a process that shares its node with other ranks takes cores // local ranks threads, at
least 1: the cores it may run on (os.sched_getaffinity, else os.cpu_count()) over the launcher's count of
processes on this node (LOCAL_WORLD_SIZE: torchrun, accelerate; LOCAL_SIZE: the deepspeed launcher). A process
alone on its node keeps torch's own choice. Set before the command runs a torch op (cli.main).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

LOCAL_RANKS_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")   # torchrun and accelerate; the deepspeed launcher


@dataclass(frozen=True)
class ThreadShare:
    threads: int            # torch threads per process
    cores: int              # cores this process may run on
    local_ranks: int        # processes on this node
    from_user: str | None   # OMP_NUM_THREADS as set, None where moe_scale chose

    @property
    def chosen(self) -> bool:
        """Whether moe_scale sets the count (several local ranks, OMP_NUM_THREADS not set)."""
        return self.from_user is None and self.local_ranks > 1

    def describe(self) -> str:
        if self.from_user is not None:
            return f"threads: {self.threads} per process (OMP_NUM_THREADS={self.from_user})"
        ranks = f"{self.local_ranks} local rank{'s' if self.local_ranks != 1 else ''}"
        return (f"threads: {self.threads} per process ({self.cores} cores, {ranks}; set OMP_NUM_THREADS to "
                f"override)")


def local_ranks(env: dict[str, str]) -> int:
    """The launcher's count of processes on this node (1 where it set none)."""
    for name in LOCAL_RANKS_VARIABLES:
        if env.get(name, "").strip().isdigit() and int(env[name]) > 0:
            return int(env[name])
    return 1


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a taskset, a cgroup's cpuset), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def thread_share(env: dict[str, str] | None = None) -> ThreadShare:
    """The thread count of this process under the rule above (torch's current count where the user set it)."""
    env = os.environ if env is None else env
    cores, ranks = usable_cores(), local_ranks(env)
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given:
        return ThreadShare(torch.get_num_threads(), cores, ranks, given)
    if ranks == 1:
        return ThreadShare(torch.get_num_threads(), cores, ranks, None)
    return ThreadShare(max(1, cores // ranks), cores, ranks, None)


def apply_thread_share(env: dict[str, str] | None = None) -> ThreadShare:
    """Give this process its share of the cores (see the module docstring); returns what it runs with."""
    share = thread_share(env)
    if share.chosen:
        torch.set_num_threads(share.threads)
    return share
