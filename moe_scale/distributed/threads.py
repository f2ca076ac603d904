"""Torch threads per process: each process of a launch takes its share of the cores, not all of them.

torch's thread pool takes every core in every process. The deepspeed launcher starts its ranks with nothing set,
so 2 ranks on 2 cores ran 4 threads on 2 cores: up to 4 times slower than one thread each, what torchrun and
`accelerate launch` set through OMP_NUM_THREADS (tools/bench_threads.py, docs/clusters.md#threads).

Unless OMP_NUM_THREADS is set (by the user, or by a launcher: torchrun, accelerate, `deepspeed
--bind_cores_to_rank`), a process that shares its node with other ranks takes cores // local ranks threads, at
least 1: the cores it may run on (os.sched_getaffinity, else os.cpu_count()) over the launcher's count of
processes on this node (LOCAL_WORLD_SIZE: torchrun, accelerate; LOCAL_SIZE: the deepspeed launcher).

A process alone on its node takes the cores other processes leave free when it starts: /proc/stat sampled over
0.2 s gives the cores others keep busy, and the process takes the rest, rounded, at least 1 and at most torch's
own choice. torch's pool spins on every core it takes; on 2 cores beside 3 spinning processes the default LSTM-MoE
ran at 2.2k tokens/s with 2 threads and 15.0k with 1 (docs/clusters.md#a-busy-machine, tools/bench_threads.py
--load). Set before the command runs a torch op (cli.main).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

LOCAL_RANKS_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")   # torchrun and accelerate; the deepspeed launcher


@dataclass(frozen=True)
class ThreadShare:
    threads: int            # torch threads per process
    cores: int              # cores this process may run on
    local_ranks: int        # processes on this node
    from_user: str | None   # OMP_NUM_THREADS as set, None where moe_scale chose
    busy: float = 0.0       # cores other processes kept busy at start (a process alone on its node)
    fewer: bool = False     # alone on its node, it takes fewer threads than torch would: cores were busy

    @property
    def chosen(self) -> bool:
        """Whether moe_scale sets the count (several local ranks, or cores busy at start; OMP_NUM_THREADS not
        set)."""
        return self.from_user is None and (self.local_ranks > 1 or self.fewer)

    def describe(self) -> str:
        if self.from_user is not None:
            return f"threads: {self.threads} per process (OMP_NUM_THREADS={self.from_user})"
        if self.local_ranks == 1:
            return (f"threads: {self.threads} ({self.cores} cores, {self.busy:.1f} of them busy with other "
                    f"processes at start; set OMP_NUM_THREADS to override)")
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


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of the machine's CPUs so far (/proc/stat), None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def busy_cores(interval: float = 0.2) -> float:
    """Cores other processes kept busy over `interval` seconds, while this one sleeps (0 where /proc/stat cannot
    be read): the machine's busy share times the cores this process may use."""
    before = _cpu_times()
    if before is None:
        return 0.0
    time.sleep(interval)
    after = _cpu_times()
    if after is None or after[1] <= before[1]:
        return 0.0
    return (after[0] - before[0]) / (after[1] - before[1]) * usable_cores()


def free_threads(default: int, cores: int, busy: float) -> int:
    """Threads for a process alone on its node: the cores others leave free, rounded, at least 1, at most
    `default` (torch's own choice)."""
    return max(1, min(default, round(cores - busy)))


def thread_share(env: dict[str, str] | None = None, busy: float | None = None) -> ThreadShare:
    """The thread count of this process under the rule above (torch's current count where the user set it).
    `busy`: the cores others keep busy (None: sampled now, for a process alone on its node)."""
    env = os.environ if env is None else env
    cores, ranks = usable_cores(), local_ranks(env)
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given:
        return ThreadShare(torch.get_num_threads(), cores, ranks, given)
    if ranks == 1:
        busy = busy_cores() if busy is None else busy
        threads = free_threads(torch.get_num_threads(), cores, busy)
        return ThreadShare(threads, cores, ranks, None, busy, threads < torch.get_num_threads())
    return ThreadShare(max(1, cores // ranks), cores, ranks, None)


def apply_thread_share(env: dict[str, str] | None = None, say: bool = True) -> ThreadShare:
    """Give this process its share of the cores (see the module docstring); returns what it runs with. A process
    alone that takes fewer threads than torch would says so in one line (`say`: a command that computes little,
    such as `plan`, takes them without a word)."""
    share = thread_share(env)
    if share.chosen:
        if share.local_ranks == 1 and say:
            print(f"moe-scale: {share.describe()}", file=sys.stderr, flush=True)
        torch.set_num_threads(share.threads)
    return share
