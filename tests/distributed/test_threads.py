"""Torch threads per process (moe_scale/distributed/threads.py): cores // local ranks, at least 1, the cores from
the CPU affinity (else the CPU count) and the local ranks from LOCAL_WORLD_SIZE or LOCAL_SIZE; OMP_NUM_THREADS
wins; a process alone on its node takes the cores others leave free (at most torch's count), a real load
included. The line a 2-rank run logs: tests/test_console.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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


def test_a_process_alone_on_an_idle_node_keeps_torchs_count(cores, torch_threads, monkeypatch):
    cores(8)
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.3)
    torch.set_num_threads(5)
    share = apply_thread_share({})
    assert not share.chosen and share.threads == 5 and torch.get_num_threads() == 5


@pytest.mark.parametrize("machine, busy, torch_count, expected", [
    (2, 1.6, 2, 1),     # the busy machine: 3-5 other processes on 2 cores
    (2, 3.0, 2, 1),     # more busy than cores: at least 1
    (16, 5.4, 16, 11),  # rounded
    (16, 2.0, 8, 8),    # never more than torch's own count
])
def test_a_process_alone_takes_the_cores_left_free(cores, torch_threads, monkeypatch, capsys, machine, busy,
                                                    torch_count, expected):
    cores(machine)
    monkeypatch.setattr(threads, "busy_cores", lambda: busy)
    torch.set_num_threads(torch_count)
    share = apply_thread_share({})
    assert share.threads == expected and torch.get_num_threads() == expected
    assert share.chosen == (expected < torch_count)
    line = f"moe-scale: threads: {expected} ({machine} cores, {busy:.1f} of them busy with other processes at " \
           f"start; set OMP_NUM_THREADS to override)\n"
    assert capsys.readouterr().err == (line if expected < torch_count else "")
    torch.set_num_threads(torch_count)
    assert apply_thread_share({}, say=False) == share and capsys.readouterr().err == ""   # (plan, flops)


def test_commands_that_compute_little_take_their_threads_without_a_word(cores, torch_threads, monkeypatch, capsys):
    from moe_scale.cli import main

    cores(2)
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.6)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)   # (the suite's: tests/parallel.py)
    for argv in (["flops", "--preset", "lm1b-moe-32"], ["plan", "--preset", "lm1b-moe-32", "--gpus", "8"]):
        torch.set_num_threads(2)
        assert main(argv) == 0 and torch.get_num_threads() == 1, argv
        assert "threads" not in capsys.readouterr().err, argv


def test_busy_cores_are_the_machines_busy_share_of_this_process_cores(cores, monkeypatch):
    cores(4)
    samples = iter([(1000, 5000), (1150, 5200)])   # (busy, total) jiffies: 150 of 200 busy
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    assert threads.busy_cores(0.0) == pytest.approx(3.0)
    monkeypatch.setattr(threads, "_cpu_times", lambda: None)
    assert threads.busy_cores(0.0) == 0.0


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")
def test_a_loaded_machine_gives_a_process_fewer_threads(torch_threads):
    """Real load: as many spinning processes as this process's cores; it takes 1 thread, not torch's count."""
    cores = threads.usable_cores()
    spinner = [sys.executable, "-S", "-c", "while True: pass"]   # -S: no site import, spinning at once
    spinners = [subprocess.Popen(spinner) for _ in range(cores)]
    try:
        time.sleep(0.3)
        torch.set_num_threads(cores)
        share = thread_share({})
        assert share.busy > cores - 0.8 and share.threads == 1, share
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
