#!/usr/bin/env python
"""Would the MoE layer's backward gain from running the router's products beside the experts' backward?

Legend (docs/shapes.md): N tokens, D model width, F expert hidden width, E experts, K experts per token, M
(token, expert) pairs that arrive; T threads.

In the backward, once the gate gradient is known, the router's four [N, D, E] products (compute-bound) and the
experts' backward (bound by streaming their weights and writing their gradients) need nothing from each
other. On one set of cores they run one after the other; the only way to overlap them on a CPU is to split
the cores, each part on its own thread with half of them. That pays only if half the cores keep most of the
memory bandwidth, as on a many-core server where a few cores saturate the memory; where one core streams at
a fraction of the machine's bandwidth, the split gains nothing. This measures which, at each (E, K):

  router_backward_s    the router's backward products with all T threads: x.T @ g (gate and noise matrices)
                       and g @ W.T (both), g an [N, E] gradient
  experts_backward_s   the experts' backward (moe_scale's GroupedExperts, native kernels where built) with
                       all T threads, the experts' gradients written into the previous step's memory
  serial_s             the two, one after the other (their sum, timed as such)
  concurrent_s         the two at once, on two threads with T - T // 2 and T // 2 threads (`split`)
  router_backward_split_s, experts_backward_split_s
                       each part alone with the threads it has in concurrent_s: why the split pays or not
  overlap_gain         serial_s / concurrent_s: > 1 where splitting the cores would pay
  ideal_gain           serial_s / max of the two alone: what a perfect overlap would give
  same_gradients       the experts' gradients computed beside the router's products equal those computed alone

    python tools/bench_overlap.py --experts 4096 --k 2      # one JSON line on stdout (and in --out)
    python tools/bench_overlap.py --experts 1024,4096 --k 1,2 --out overlap.jsonl
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from json_lines import emit, sig
from tool_args import OneLineParser, check_out_file, positive_int, positive_int_list

import moe_scale  # noqa: F401  (first: its host-memory policy, as the layer is trained with, before torch allocates)
import torch

from moe_scale.host_memory import apply_process_settings

from moe_scale.moe.experts import GroupedExperts


def parse_args(argv: list[str] | None = None):
    parser = OneLineParser(description="Router backward beside the experts' backward, on split cores")
    parser.add_argument("--experts", type=positive_int_list, default=[1024, 4096])
    parser.add_argument("--k", type=positive_int_list, default=[2])
    parser.add_argument("--tokens", type=positive_int, default=2048)
    parser.add_argument("--d", type=positive_int, default=256)
    parser.add_argument("--h", type=positive_int, default=512)
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs of each; the median is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.threads < 2:
        parser.error(f"--threads must be at least 2 to split them between the two parts, got {args.threads}")
    bad = [(e, k) for e in args.experts for k in args.k if k > e]
    if bad:
        parser.error(f"--k must not exceed --experts, got k={bad[0][1]} with {bad[0][0]} experts")
    check_out_file(parser, args.out)
    return args


class RouterBackward:
    """The noisy gate's backward products: grad W_gate = x.T @ g_gate, grad W_noise = x.T @ g_noise and
    grad x = g_gate @ W_gate.T + g_noise @ W_noise.T."""

    def __init__(self, n: int, d: int, e: int, gen: torch.Generator):
        self.x_ND = torch.randn(n, d, generator=gen)
        self.w_DE = [torch.randn(d, e, generator=gen) / d ** 0.5 for _ in range(2)]
        self.g_NE = [torch.randn(n, e, generator=gen) * 1e-3 for _ in range(2)]

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(grad W_gate [D, E], grad W_noise [D, E], grad x [N, D])."""
        (w_gate, w_noise), (g_gate, g_noise) = self.w_DE, self.g_NE
        grad_x_ND = torch.addmm(g_gate @ w_gate.t(), g_noise, w_noise.t())
        return self.x_ND.t() @ g_gate, self.x_ND.t() @ g_noise, grad_x_ND


class ExpertsBackward:
    """GroupedExperts' backward for N tokens routed to K random experts each, from a fixed output gradient."""

    def __init__(self, n: int, d: int, h: int, e: int, k: int, gen: torch.Generator):
        self.experts = GroupedExperts(e, d, h, seed=0)
        expert_M = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]).flatten()
        expert_M, order = expert_M.sort(stable=True)
        self.row_of_pair_M = torch.arange(n).repeat_interleave(k)[order]
        self.counts = torch.bincount(expert_M, minlength=e).tolist()
        self.gate_M = torch.rand(n * k, generator=gen).requires_grad_(True)
        self.rows_ND = torch.randn(n, d, generator=gen).requires_grad_(True)
        self.grad_y_ND = torch.randn(n, d, generator=gen)
        self.y_ND = self.experts(self.rows_ND, self.counts, self.row_of_pair_M, self.gate_M)

    def __call__(self) -> None:
        for t in (self.experts.w_in, self.experts.w_out, self.rows_ND, self.gate_M):
            t.grad = None   # as an optimizer step leaves them: the kernels write into the freed memory
        self.y_ND.backward(self.grad_y_ND, retain_graph=True)

    def gradients(self) -> list[torch.Tensor]:
        """The last backward's gradients (the weights' are overwritten by the next: clone to keep them)."""
        return [t.grad for t in (self.experts.w_in, self.experts.w_out, self.rows_ND, self.gate_M)]


def _with_threads(threads: int, work: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        torch.set_num_threads(threads)   # per OS thread for torch's OpenMP pool and for the native kernels
        work()
    return run


def _seconds(work: Callable[[], None]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _side_by_side(first: Callable[[], None], second: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            second()
        except BaseException as err:   # re-raised on the calling thread
            errors.append(err)

    helper = threading.Thread(target=guarded)
    helper.start()
    first()
    helper.join()
    if errors:
        raise errors[0]


def measure(e: int, k: int, args) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    router = RouterBackward(args.tokens, args.d, e, gen)
    experts = ExpertsBackward(args.tokens, args.d, args.h, e, k, gen)
    all_threads, half = args.threads, args.threads // 2
    router_alone, experts_alone = _with_threads(all_threads, router), _with_threads(all_threads, experts)
    router_half, experts_half = _with_threads(all_threads - half, router), _with_threads(half, experts)

    def serial() -> None:
        router_alone()
        experts_alone()

    def concurrent() -> None:
        _side_by_side(router_half, experts_half)

    runs = {"router": router_alone, "experts": experts_alone, "serial": serial, "concurrent": concurrent,
            "router_split": router_half, "experts_split": experts_half}
    timings: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for run in (concurrent, router_alone, experts_alone):   # untimed: first touch of memory, buffers kept
            run()
        reference = [grad.clone() for grad in experts.gradients()]   # computed alone
        same = True
        for _ in range(args.repeats):   # interleaved, so that a slow minute of a shared machine hits them all
            for name, run in runs.items():
                timings[name].append(_seconds(run))
                if name == "concurrent":
                    same = same and all(torch.equal(a, b) for a, b in zip(reference, experts.gradients()))
    finally:
        torch.set_num_threads(all_threads)
    t = {name: statistics.median(seconds) for name, seconds in timings.items()}
    return {"experts": e, "k": k, "tokens": args.tokens, "d": args.d, "h": args.h, "threads": all_threads,
            "split": [all_threads - half, half], "repeats": args.repeats,
            "router_backward_s": sig(t["router"]), "experts_backward_s": sig(t["experts"]),
            "serial_s": sig(t["serial"]), "concurrent_s": sig(t["concurrent"]),
            "router_backward_split_s": sig(t["router_split"]), "experts_backward_split_s": sig(t["experts_split"]),
            "overlap_gain": round(t["serial"] / t["concurrent"], 3),
            "ideal_gain": round(t["serial"] / max(t["router"], t["experts"]), 3), "same_gradients": same}


def main(argv: list[str] | None = None) -> None:
    apply_process_settings()   # as the moe-scale command does: THP and freed memory kept
    args = parse_args(argv)
    for e in args.experts:
        for k in args.k:
            emit(measure(e, k, args), args.out)


if __name__ == "__main__":
    main()
