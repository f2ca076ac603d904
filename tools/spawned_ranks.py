"""Ranks of a tool as spawned processes on this machine: `target(rank, world, port, args, queue)` on each, and what
rank 0 puts on the queue (until None) handed back as it comes."""

from __future__ import annotations

from typing import Callable, Iterator


def spawned_ranks(target: Callable, ranks: int, args, tool: str) -> Iterator:
    import torch.multiprocessing as mp

    from moe_scale.distributed.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, ranks, port, args, queue)) for r in range(ranks)]
    for proc in procs:
        proc.start()
    while (item := queue.get()) is not None:
        yield item
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"{tool}: error: rank exited with status {proc.exitcode}")
