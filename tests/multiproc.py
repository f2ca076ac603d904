"""Run test functions on N CPU processes joined by a gloo process group.

    results = run_ranks(worker, world_size=2, args=(case,))     # worker(rank, world_size, case) -> picklable

`worker` must be a module-level function (the ranks are separate processes and import it by name). Each rank
returns a value (tensors are fine: results travel as `torch.save` bytes, so nothing depends on shared memory
outliving a worker); `run_ranks` returns them in rank order. A rank that raises makes the test fail with
that rank's traceback; ranks that hang (a collective that never matches) are killed after `timeout` seconds
and the test fails with "timed out" instead of hanging the session.

Ranks are forked from the warm server of tests/forked.py (torch and DeepSpeed imported already), and the ranks
of one world size are kept in a pool and reused by later calls (one gloo and DeepSpeed initialisation per rank);
a failure or a timeout throws the pool away, and the next call starts a fresh one. Consequences for workers:
seed every random draw explicitly (the global RNG carries over from earlier tasks), create process groups
collectively (`torch.distributed.new_group` on every rank), and never init or destroy the default process group
yourself.

`deepspeed=True` also initialises DeepSpeed's communication backend (`deepspeed.init_distributed`, what
the engine does) so `deepspeed.utils.groups` can build expert-parallel groups; its groups then persist in
the pool, exactly as they persist in a training process.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import atexit
import io
import queue
import traceback
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch

from moe_scale.distributed.launch import init_deepspeed_comm
from moe_scale.distributed.ports import free_port
from tests import forked

COLLECTIVE_TIMEOUT_S = 60
STARTUP_ALLOWANCE_S = 90


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(rank: int, world_size: int, port: int, tasks, results) -> None:
    """A pooled rank: join the gloo group, then run tasks until told to stop (None)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size,
                                             timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))
        return
    while (task := tasks.get()) is not None:
        fn, args, use_deepspeed = task
        try:
            if use_deepspeed:
                # torch.distributed is up already: this only wraps it in DeepSpeed's backend (once).
                init_deepspeed_comm("gloo", verbose=False, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            results.put((rank, True, _to_bytes(fn(rank, world_size, *args))))
        except BaseException:  # noqa: BLE001
            results.put((rank, False, traceback.format_exc()))
    torch.distributed.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int):
        ctx = forked.context()   # forked from the warm server: no imports to wait for
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_rank_main, args=(rank, world_size, port, self.tasks[rank], self.results),
                                  daemon=True, name=f"test-rank-{rank}") for rank in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple, timeout: float, use_deepspeed: bool) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args, use_deepspeed))
        received: dict[int, Any] = {}
        for _ in range(self.world_size):
            try:
                rank, ok, payload = self.results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(received))
                raise _RankFailure(f"{fn.__name__}{args}: ranks {missing} timed out after {timeout:.0f} s "
                                   f"(a collective that never matched?)") from None
            if not ok:
                raise _RankFailure(f"{fn.__name__}{args}: rank {rank} failed:\n{payload}")
            received[rank] = _from_bytes(payload)
        return [received[r] for r in range(self.world_size)]

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=5 if graceful else 0.1)
            if p.is_alive():
                p.kill()
                p.join()


class _RankFailure(Exception):
    pass


_POOLS: dict[int, RankPool] = {}


def run_ranks(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 60.0,
              deepspeed: bool = False) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; return their results in rank order."""
    forked.note_ranks(world_size)
    pool = _POOLS.get(world_size)
    if pool is None:  # a fresh pool may first start the warm server: allow more
        pool = _POOLS[world_size] = RankPool(world_size)
        timeout += STARTUP_ALLOWANCE_S
    try:
        return pool.run(fn, args, timeout, deepspeed)
    except _RankFailure as failure:
        _POOLS.pop(world_size).close(graceful=False)   # ranks may be stuck in a collective: start afresh
        pytest.fail(str(failure))


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()
