#!/usr/bin/env python
"""Forward+backward time of the expert computation: grouped experts vs the naive sliced loop vs a dense FFN.

Legend (docs/shapes.md): N tokens, K experts per token, R rows that arrive (N·K, sorted by expert), D model width,
F expert hidden width, E experts. Rows per expert are drawn from a uniform multinomial with a fixed seed.

Implementations, all timed in the same run, interleaved repeat by repeat so machine noise hits them alike:
  grouped      moe_scale's GroupedExperts (custom grouped-matmul autograd function), once per --kernels entry:
               auto (GroupLayout's choice), native (moe/cpu_backend/cpu_kernels.c), grouped (torch's grouped GEMM),
               triton (DeepSpeed's Triton grouped GEMM, CUDA), loop.
  sliced_loop  the naive reference: a Python loop of relu(x[a:b] @ w_in[e].T) @ w_out[e] over nn.Parameter
               stacks. Autograd builds a full-size [E, D, F] gradient per expert slice: O(E^2). Skipped
               above --max-naive-experts (a JSON line with "skipped" says so).
  dense        one D -> F -> D ReLU MLP over all R rows: the same active FLOPs as the experts.

One JSON line per (experts, impl, kernel) on stdout (and in --out). Grouped and sliced_loop outputs and
gradients (input, w_in, w_out) are compared on the warm-up step; the max abs diff is reported on both lines.

    python tools/bench_experts.py --experts 64 --repeats 2
    python tools/bench_experts.py --experts 64,1024 --kernels native,grouped --max-naive-experts 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tool_args import OneLineParser, check_out_file, non_negative_int, positive_int, positive_int_list

import torch

from moe_scale.host_memory import apply_process_settings
from torch import nn

from moe_scale.moe.cpu_backend import kernels as cpu_kernels
from moe_scale.moe.experts import GroupedExperts, expert_ffn
from moe_scale.moe.experts.grouped_gemm import KERNELS, GroupLayout, kernel_for

KERNEL_CHOICES = ("auto",) + KERNELS


def _kernel_list(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    bad = [t for t in items if t not in KERNEL_CHOICES]
    if bad or len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"expected distinct names from {','.join(KERNEL_CHOICES)}, got {text!r}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="bench_experts.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=positive_int_list, default=[8, 64, 256, 1024],
                   help="comma-separated expert counts E (default 8,64,256,1024)")
    p.add_argument("--tokens", type=positive_int, default=2048, help="tokens N (default 2048)")
    p.add_argument("--k", type=positive_int, default=2, help="top-k: the experts see N*k rows (default 2)")
    p.add_argument("--d", type=positive_int, default=256, help="model dim D (default 256)")
    p.add_argument("--h", type=positive_int, default=512, help="expert hidden width F (default 512)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed steps after 1 warm-up (default 5)")
    p.add_argument("--max-naive-experts", type=non_negative_int, default=256,
                   help="skip sliced_loop when E is above this (O(E^2); default 256, 0 = never run it)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed for counts, inputs, weights (default 0)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu; cuda times with synchronize)")
    p.add_argument("--kernels", type=_kernel_list, default=["auto"],
                   help=f"comma-separated kernels for the grouped impl, from {','.join(KERNEL_CHOICES)} (default auto)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON lines to this file")
    args = p.parse_args(argv)
    check_out_file(p, args.out)
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        p.error(f"--device {args.device!r} is not usable here ({str(exc).splitlines()[0]}); try --device cpu")
    args.device = device
    like = torch.empty(0, device=device)
    if "native" in args.kernels and not cpu_kernels.available(like):
        p.error(f"--kernels native: the native kernels take CPU float32 and a built library, not available here "
                f"(device {device}); choose from auto,grouped,triton,loop")
    for kernel in ("grouped", "triton"):
        capability = torch.cuda.get_device_capability(like.device) if like.is_cuda else None
        if kernel in args.kernels and kernel_for(like.device.type, like.dtype, capability, True, True)[0] != kernel:
            p.error(f"--kernels {kernel}: not for {like.device.type} {like.dtype} here; choose from auto,loop and "
                    f"the kernel auto picks")
    return args


def rows_per_expert(num_rows: int, num_experts: int, seed: int) -> list[int]:
    """counts_E ~ Multinomial(num_rows, uniform over E), reproducible from seed."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(num_experts, (num_rows,), generator=g)
    return torch.bincount(draws, minlength=num_experts).tolist()


def sliced_loop_forward(x_RD, w_in_EFD, w_out_EFD, counts_E, scale):
    """The O(E^2) trap: w[e] on a Parameter stack inside a Python loop."""
    outs, start = [], 0
    for e, count in enumerate(counts_E):
        if count:
            outs.append(torch.relu(x_RD[start:start + count] @ w_in_EFD[e].t()) @ w_out_EFD[e])
            start += count
    return torch.cat(outs) * scale


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_one(num_experts: int, args: argparse.Namespace) -> list[dict]:
    n_rows, dev = args.tokens * args.k, args.device
    counts_E = rows_per_expert(n_rows, num_experts, args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    x_RD = torch.randn(n_rows, args.d, generator=g).to(dev).requires_grad_(True)
    grad_RD = torch.randn(n_rows, args.d, generator=g).to(dev)

    experts = GroupedExperts(num_experts, args.d, args.h, seed=args.seed).to(dev)
    scale = experts.output_scale
    run_naive = num_experts <= args.max_naive_experts
    kernel_of = {f"grouped[{kernel}]": kernel for kernel in args.kernels}   # one grouped impl per kernel
    grouped = list(kernel_of)
    order = grouped + ["sliced_loop", "dense"]
    params = {impl: [experts.w_in, experts.w_out] for impl in grouped}
    if run_naive:
        params["sliced_loop"] = [nn.Parameter(experts.w_in.detach().clone()),
                                 nn.Parameter(experts.w_out.detach().clone())]
    dense_in = nn.Parameter(torch.randn(args.d, args.h, generator=g).mul_(args.d ** -0.5).to(dev))
    dense_out = nn.Parameter(torch.randn(args.h, args.d, generator=g).mul_(args.h ** -0.5).to(dev))
    params["dense"] = [dense_in, dense_out]

    def grouped_forward(kernel: str):
        return lambda: expert_ffn(x_RD, experts.w_in, experts.w_out, counts_E, scale=scale,
                                  kernel=None if kernel == "auto" else kernel, grad_buffers=experts.grad_buffers)

    forwards = {
        **{impl: grouped_forward(kernel) for impl, kernel in kernel_of.items()},
        "sliced_loop": lambda: sliced_loop_forward(x_RD, *params["sliced_loop"], counts_E, scale),
        "dense": lambda: torch.relu(x_RD @ dense_in) @ dense_out * scale,
    }
    impls = [i for i in order if i in params]

    def step(impl: str):
        for t in [x_RD, *params[impl]]:
            t.grad = None
        _sync(dev)
        t0 = time.perf_counter()
        out = forwards[impl]()
        out.backward(grad_RD)
        _sync(dev)
        return time.perf_counter() - t0, out.detach()

    warm = {}
    for impl in impls:  # warm-up; keep grouped and sliced_loop results for the agreement check
        _, out = step(impl)
        if impl != "dense":
            warm[impl] = [out, x_RD.grad.clone(), *(p.grad.clone() for p in params[impl])]
    max_abs_diff = {}
    if run_naive:
        for impl in grouped:
            max_abs_diff[impl] = max((a - b).abs().max().item() for a, b in zip(warm[impl], warm["sliced_loop"]))
        max_abs_diff["sliced_loop"] = max(max_abs_diff.values())
    del warm

    times = {impl: [] for impl in impls}
    for _ in range(args.repeats):  # interleaved so drifting machine load hits every impl alike
        for impl in impls:
            times[impl].append(step(impl)[0])
    ms = {impl: 1e3 * statistics.median(ts) for impl, ts in times.items()}

    base = {"experts": num_experts, "k": args.k, "tokens": args.tokens, "rows": n_rows, "d": args.d, "h": args.h}
    layout = GroupLayout(counts_E, x_RD.detach())
    lines = []
    for impl in order:
        name, kernel = ("grouped", kernel_of[impl]) if impl in kernel_of else (impl, None)
        line = {**base, "impl": name, "kernel": kernel, "ms_per_step": None, "speedup_vs_sliced_loop": None,
                "ratio_to_dense": None, "max_abs_diff": None, "skipped": None}
        if kernel == "auto":   # what GroupLayout picked
            line["kernel"] = f"auto: {layout.kernel}"
        if impl not in ms:
            line["skipped"] = f"experts {num_experts} > --max-naive-experts {args.max_naive_experts}"
        else:
            line["ms_per_step"] = round(ms[impl], 3)
            if "sliced_loop" in ms:
                line["speedup_vs_sliced_loop"] = round(ms["sliced_loop"] / ms[impl], 3)
            line["ratio_to_dense"] = round(ms[impl] / ms["dense"], 3)
            line["max_abs_diff"] = max_abs_diff.get(impl)
        line.update(repeats=args.repeats, threads=torch.get_num_threads(), device=str(dev))
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()   # as the moe-scale command does: THP and freed memory kept
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out_lines = []
    for num_experts in args.experts:
        for line in bench_one(num_experts, args):
            if line["skipped"]:
                print(f"note: sliced_loop skipped at experts={num_experts} ({line['skipped']})", file=sys.stderr)
            text = json.dumps(line)
            print(text, flush=True)
            out_lines.append(text)
    if args.out is not None:
        args.out.write_text("\n".join(out_lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
