"""Run a test function on N CPU processes joined by a gloo process group.

    results = run_ranks(worker, world_size=2, args=(case,))     # worker(rank, world_size, case) -> picklable

`worker` must be a module-level function (the processes are spawned, so they import it by name). Each rank
returns a value (tensors are fine: results travel as `torch.save` bytes, so nothing depends on shared memory
outliving the worker); `run_ranks` returns them in rank order. A rank that raises makes the test fail with
that rank's traceback; ranks that hang (a collective that never matches) are killed after `timeout` seconds
and the test fails with "timed out", instead of hanging the whole test session.

`deepspeed=True` initialises torch.distributed through `deepspeed.init_distributed` (what the engine does),
so `deepspeed.utils.groups` can build expert-parallel groups; otherwise plain `init_process_group("gloo")`.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import io
import multiprocessing as mp
import queue
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _entry(fn: Callable, rank: int, world_size: int, port: int, use_deepspeed: bool, collective_timeout: float,
           args: tuple, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        timeout = timedelta(seconds=collective_timeout)
        if use_deepspeed:
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=timeout,
                                       rank=rank, world_size=world_size)
        else:
            torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
        value = fn(rank, world_size, *args)
        results.put((rank, True, _to_bytes(value)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ranks(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 60.0,
              deepspeed: bool = False) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` spawned gloo ranks; return their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, deepspeed, timeout, args, results),
                         daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    received: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(received) - {int(f.split()[1]) for f in failures})
                pytest.fail(f"ranks {missing} timed out after {timeout:.0f} s (a collective hung?)"
                            + "".join("\n" + f for f in failures))
            if ok:
                received[rank] = _from_bytes(payload)
            else:
                failures.append(f"rank {rank} failed:\n{payload}")
                break  # the other ranks are probably stuck in a collective now
        if failures:
            pytest.fail("\n".join(failures))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [received[r] for r in range(world_size)]
