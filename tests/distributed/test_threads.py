"""Torch threads per process (moe_scale/distributed/threads.py): cores // local ranks, at least 1, the cores from
the CPU affinity (else the CPU count) and the local ranks from LOCAL_WORLD_SIZE or LOCAL_SIZE; OMP_NUM_THREADS
wins; a process alone on its node keeps torch's count. The line a 2-rank run logs: tests/test_console.py."""

from __future__ import annotations

import os

import pytest
import torch

from moe_scale.distributed import threads
from moe_scale.distributed.threads import ThreadShare, apply_thread_share, local_ranks, thread_share


@pytest.fixture
def cores(monkeypatch):
    """cores(n): this process may run on n CPUs (its affinity)."""
    def set_cores(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)
    return set_cores


@pytest.fixture
def torch_threads():
    """torch's thread count is restored after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("env, ranks", [
    ({}, 1),
    ({"LOCAL_WORLD_SIZE": "4"}, 4),                     # torchrun, accelerate
    ({"LOCAL_SIZE": "2"}, 2),                           # the deepspeed launcher
    ({"LOCAL_WORLD_SIZE": "3", "LOCAL_SIZE": "2"}, 3),
    ({"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "2"}, 2),   # empty or not a count: the next one
    ({"LOCAL_SIZE": "two"}, 1),
    ({"LOCAL_SIZE": "0"}, 1),
])
def test_local_ranks_come_from_the_launcher(env, ranks):
    assert local_ranks(env) == ranks


@pytest.mark.parametrize("machine, env, expected", [
    (2, {"LOCAL_SIZE": "2"}, 1),             # the machine: 2 ranks on 2 cores
    (16, {"LOCAL_WORLD_SIZE": "4"}, 4),
    (7, {"LOCAL_SIZE": "2"}, 3),             # rounded down: never more threads than cores
    (2, {"LOCAL_SIZE": "8"}, 1),             # more ranks than cores: at least 1
])
def test_each_process_takes_its_share_of_the_cores(cores, torch_threads, machine, env, expected):
    cores(machine)
    share = apply_thread_share(env)
    assert share == ThreadShare(expected, machine, local_ranks(env), None) and share.chosen
    assert torch.get_num_threads() == expected
    assert share.describe() == (f"threads: {expected} per process ({machine} cores, {local_ranks(env)} local ranks; "
                                f"set OMP_NUM_THREADS to override)")


def test_the_cpu_count_stands_in_for_a_missing_affinity(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    assert threads.usable_cores() == 12
    assert thread_share({"LOCAL_SIZE": "4"}).threads == 3
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert threads.usable_cores() == 1


def test_the_users_omp_num_threads_is_left_alone(cores, torch_threads):
    cores(8)
    torch.set_num_threads(3)   # what torch took from OMP_NUM_THREADS=3 at start-up
    share = apply_thread_share({"OMP_NUM_THREADS": "3", "LOCAL_SIZE": "2"})
    assert not share.chosen and share.from_user == "3" and torch.get_num_threads() == 3
    assert share.describe() == "threads: 3 per process (OMP_NUM_THREADS=3)"


def test_a_process_alone_on_its_node_keeps_torchs_count(cores, torch_threads):
    cores(8)
    torch.set_num_threads(5)
    share = apply_thread_share({})
    assert not share.chosen and share.threads == 5 and torch.get_num_threads() == 5
