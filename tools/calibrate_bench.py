"""The machine constants of the planner's time model, measured with P CPU processes at once (one thread each, as
the training runs use them): tools/calibrate_plan.py's first half.

Per process count P, every rank at the same time (so processes that share cores each see their share):
  matmul       TFLOPS of fp32 matmuls (1024 x 1024, the median of timed batches) per process
  optimizer    GB/s of a fused AdamW step, counting 28 bytes per parameter (read p, g, m, v; write p, m, v: the
               planner's count without the 4 of clipping)
  all-to-all   gloo all_to_all_single over all P ranks and, for P = 4, over pairs (the hierarchical hops), at
               several sizes; fitted as latency + per-peer latency x (peers) + bytes that leave the rank / GB/s
  all-reduce   gloo all_reduce over the P ranks at several sizes; fitted as latency + 2 (P-1)/P bytes / GB/s
(the fits weigh every sample by its relative error).

Per model and P, just before its training runs (`model_compute`): the model's forward and backward on P
processes at once, each on its share of the batch, and how much longer each step takes when the ranks then meet
at a collective (the straggler share: on a shared, oversubscribed CPU every collective waits for the rank the
scheduler held back).
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

A2A_BYTES = (16 << 10, 128 << 10, 1 << 20, 4 << 20)     # what one rank sends in one call, all peers together
ALLREDUCE_BYTES = (16 << 10, 256 << 10, 4 << 20)
ADAM_PARAMS = 1 << 21


def _timed(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn` after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _matmul_tflops(torch) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    per_batch = _timed(lambda: [torch.mm(a, b) for _ in range(4)], repeats=7)
    return 4 * 2 * 1024 ** 3 / per_batch / 1e12


def _adam_gbs(torch) -> float:
    p = torch.nn.Parameter(torch.randn(ADAM_PARAMS))
    p.grad = torch.randn(ADAM_PARAMS)
    optimizer = torch.optim.AdamW([p], lr=1e-3, fused=True)
    return 28 * ADAM_PARAMS / _timed(optimizer.step, repeats=7) / 1e9


def _collectives(torch, dist, rank: int, world: int) -> dict:
    groups = {world: None}
    if world == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups[2] = pairs[rank // 2]
    a2a = []
    for size, group in groups.items():
        for nbytes in A2A_BYTES:
            send = torch.zeros(nbytes // 4)
            recv = torch.empty_like(send)

            def call():
                dist.all_to_all_single(recv, send, group=group)
            dist.barrier()
            a2a.append((size, nbytes, _timed(call, repeats=9)))
    reduce = []
    for nbytes in ALLREDUCE_BYTES:
        buffer = torch.zeros(nbytes // 4)
        dist.barrier()
        reduce.append((nbytes, _timed(lambda: dist.all_reduce(buffer), repeats=9)))
    return {"all_to_all": a2a, "all_reduce": reduce}


def worker(rank: int, world: int, port: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()
    result = {"matmul_tflops": _matmul_tflops(torch)}
    dist.barrier()
    result["optimizer_gbs"] = _adam_gbs(torch)
    if world > 1:
        result.update(_collectives(torch, dist, rank, world))
    queue.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def compute_worker(rank: int, world: int, port: int, queue, config_dict: dict, vocab: int) -> None:
    """The model's forward and backward on this rank's share of the batch (no DeepSpeed, no exchange: ep 1), with
    the P ranks at once; each step then meets the others at an all-reduce of one number, as a training step's
    collectives meet: the time past one's own compute is the wait for the slowest rank."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from moe_scale.config import RunConfig
    from moe_scale.models.build import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = RunConfig.from_dict(config_dict, "calibration")
    torch.manual_seed(rank)
    model = build_model(config, vocab)
    model.train()
    inputs = torch.randint(0, vocab, (config.train.batch_size // world, config.data.seq_len))
    one = torch.zeros(1)

    def step():
        out = model(inputs, inputs)
        (out.nll_sum / out.num_tokens + out.aux_loss).backward()
        model.zero_grad(set_to_none=False)
    dist.barrier()
    rate = _matmul_tflops(torch)
    for _ in range(2):
        step()
    own, whole = [], []
    for _ in range(9):
        dist.all_reduce(one)
        began = time.perf_counter()
        step()
        own.append(time.perf_counter() - began)
        dist.all_reduce(one)
        whole.append(time.perf_counter() - began)
    queue.put((rank, {"matmul_tflops": rate, "compute_s": statistics.median(own),
                      "synchronised_s": statistics.median(whole)}))
    dist.barrier()
    dist.destroy_process_group()


def model_compute(config, vocab: int, world: int) -> dict:
    """The model's compute with `world` processes at once: seconds of one rank's forward and backward, the matmul
    rate each rank saw, and the share the wait for the slowest rank adds (`straggler`)."""
    ranks = measure(world, compute_worker, config.to_dict(), vocab)
    compute = statistics.mean(r["compute_s"] for r in ranks)
    synchronised = statistics.mean(r["synchronised_s"] for r in ranks)
    return {"procs": world, "compute_s": compute, "matmul_tflops": statistics.mean(r["matmul_tflops"] for r in ranks),
            "straggler": max(0.0, synchronised / compute - 1) if world > 1 else 0.0}


def measure(world: int, target=worker, *extra) -> list[dict]:
    """Every rank's measurements, in rank order."""
    import torch.multiprocessing as mp

    from moe_scale.distributed.ports import free_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    procs = [context.Process(target=target, args=(rank, world, port, queue, *extra)) for rank in range(world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise RuntimeError(f"calibration rank exited with {proc.exitcode}")
    return [results[r] for r in range(world)]


def _relative_fit(rows: list[list[float]], seconds: list[float]) -> np.ndarray:
    """Least squares of the relative error (each sample weighted by 1/its time): small and large messages count
    alike, as the training runs send both."""
    weights = 1 / np.array(seconds)
    return np.linalg.lstsq(np.array(rows) * weights[:, None], np.ones(len(seconds)), rcond=None)[0]


def fit_all_to_all(samples: list[tuple[int, int, float]]) -> dict:
    """latency_s + per_peer_s x (g - 1) + nbytes (g - 1) / g / bandwidth over (g, nbytes, seconds) samples
    (per_peer_s is 0 when one group size was measured); negative latencies are taken as 0."""
    sizes = sorted({g for g, _, _ in samples})
    rows = [[1.0, *([g - 1.0] if len(sizes) > 1 else []), nbytes * (g - 1) / g] for g, nbytes, _ in samples]
    coef = _relative_fit(rows, [t for _, _, t in samples])
    latency, per_peer, per_byte = (coef[0], coef[1], coef[2]) if len(sizes) > 1 else (coef[0], 0.0, coef[1])
    return {"latency_s": max(float(latency), 0.0), "per_peer_s": max(float(per_peer), 0.0),
            "gbs": 1 / float(per_byte) / 1e9}


def fit_all_reduce(samples: list[tuple[int, float]], world: int) -> dict:
    rows = [[1.0, 2 * (world - 1) / world * nbytes] for nbytes, _ in samples]
    coef = _relative_fit(rows, [t for _, t in samples])
    return {"latency_s": max(float(coef[0]), 0.0), "gbs": 1 / float(coef[1]) / 1e9}


def constants(world: int) -> dict:
    """The fitted constants with P = `world` processes (means over the ranks)."""
    ranks = measure(world)
    out = {"procs": world, "matmul_tflops": statistics.mean(r["matmul_tflops"] for r in ranks),
           "optimizer_gbs": statistics.mean(r["optimizer_gbs"] for r in ranks)}
    if world > 1:
        a2a = [(g, n, statistics.mean(r["all_to_all"][i][2] for r in ranks))
               for i, (g, n, _) in enumerate(ranks[0]["all_to_all"])]
        reduce = [(n, statistics.mean(r["all_reduce"][i][1] for r in ranks))
                  for i, (n, _) in enumerate(ranks[0]["all_reduce"])]
        out.update(all_to_all=fit_all_to_all(a2a), all_reduce=fit_all_reduce(reduce, world),
                   samples={"all_to_all": a2a, "all_reduce": reduce})
    return out
