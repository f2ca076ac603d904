#!/usr/bin/env python
"""Forward+backward time and working memory of moe_scale's MoE layer vs DeepSpeed's MoE layer, a dense FFN
and this machine's roofline, all measured in one run.

Legend (docs/shapes.md): N tokens, D model width, F expert hidden width, E experts, K experts per token, C
(token, expert) pairs routed.

Implementations (one JSON line each per (E, K), on stdout and in --out):
  dropless            moe_scale MoELayer: noisy top-k gate (W_g and W_noise, both CV^2 losses), every copy kept;
                      as trained by default: native CPU kernels where built, gradient memory reused
  capacity            the same layer in capacity mode (--capacity-factor, lowest gates dropped)
  deepspeed_dropless  deepspeed.moe.layer.MoE with the same experts, drop_tokens=False
  deepspeed_capacity  deepspeed.moe.layer.MoE, capacity_factor=--capacity-factor, drop_tokens=True
  naive_loop          the issue's reference point, a naive sort-and-loop layer: moe_scale's router, then the
                      pairs sorted by expert and a Python loop over E nn.Sequential FFNs on their tokens' rows
  dense               one D -> F' -> D ReLU FFN with the same active FLOPs as `dropless`:
                      F' = K*F + 2*E (2*D*E multiply-adds per token for the two gating matrices)

Roofline (per implementation, from peaks measured in this run, before every configuration; the best seen is
used): max(FLOPs / matmul peak, bytes / memory bandwidth) with FLOPs = 3 x 2 x forward multiply-adds of the
experts and the gating matrices (DeepSpeed's gate has one matrix, ours two; the dense FFN its own), and
bytes = what a forward and backward must move of the expert weights and their gradients: the weights of the
experts the step sent tokens to, read by the forward and read again by the backward, and the gradients of all
experts written ((2 x used + E) x one expert's bytes, "experts_used" counted after the last timed step as the
experts whose gradient is not all zeros; the least possible once the weights outgrow the last-level cache,
which they do from E = 64 here; below that the FLOPs set the bound). With 2048 tokens at E = 4096, k = 1, only
about 39% of the experts receive a token: counting every expert's weights read twice would loosen that bound
by 1.7x. The matmul peak is the best of fp32 [2048x2048]@[2048x2048] after a warm-up product; the
bandwidth the best of a 256 MiB copy, counting its bytes read and written, as STREAM does. A shared machine's
bandwidth moves 2x within a minute, so each row also gives the median of 6 copies timed just before and after
that layer's steps (bandwidth_then_gbs) and its fraction of the bound at that bandwidth
(roofline_fraction_then): how much of the gap the machine's moment explains. A layer that runs the router's
products and the experts one after the other (the forward must: the router decides where the tokens go; the
backward could run them side by side only on split cores, which tools/bench_overlap.py measures) takes at
best router FLOPs / peak + max(expert FLOPs / peak, bytes / bandwidth): serial_bound_s. serial_ceiling =
roofline / that, the most of the roofline such a schedule reaches at these peaks (0.5 where the two terms are
equal); serial_fraction = that / time. Working memory =
peak resident memory during one step above the memory before it, with the expert weights
frozen so that their gradients are never allocated (the dense FFN's weights likewise): what the step needs
beyond the expert weights and their gradients. Measured in a child process with glibc's mmap threshold at
64 KiB, so freed tensors leave the resident set at once and the peak is the peak of live tensors.
Each time is the median over the timed steps of a freshly built layer, after --warmup untimed ones: at least
--repeats, and on until they add up to --min-time seconds (see timed_steps).

    python tools/bench_moe_layer.py --experts 1024 --k 2          # one configuration
    python tools/bench_moe_layer.py --out bench.jsonl               # the whole sweep (E 8..4096, K 1,2,4)
    python tools/bench_moe_layer.py --ranks 2 --experts 256 --k 2   # 2 gloo ranks, ep_size 2: all-to-all share
    python tools/bench_moe_layer.py --ranks 2 --experts 64 --k 2 --a2a-chunks 1,2,4   # the exchange overlapped
    python tools/bench_moe_layer.py --experts 1024 --k 2 --gate-logit-std 3   # logits spread as after training

On a GPU (`--device cuda --dtype bfloat16`, what tools/gpu_check.sh runs) the roofline takes the GPU's datasheet
peaks (metrics/perf.py; --peak-tflops / --peak-gbs override), bytes count the dtype's size, each step is timed
between two synchronisations, working memory is the CUDA allocator's peak above the memory before the step, and
a configuration whose expert weights and gradients cannot fit the device is reported as skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from json_lines import emit, sig
from spawned_ranks import spawned_ranks
from tool_args import (OneLineParser, check_out_file, non_negative_float, non_negative_int, positive_float,
                        positive_int, positive_int_list)

import torch

from moe_scale.host_memory import apply_process_settings
from torch import nn

from moe_scale.distributed.launch import init_deepspeed_comm
from moe_scale.distributed.ports import free_port

IMPLS = ("dropless", "capacity", "deepspeed_dropless", "deepspeed_capacity", "naive_loop", "dense")
BALANCEABLE = ("dropless", "capacity")   # --force-balanced-routing: moe_scale's own layers
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHT_READS = 2   # the forward reads a used expert's weights, the backward reads them again
_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
# Copies timed just before and just after each layer's steps. On a shared machine the bandwidth moves 2x within
# a minute, so a layer that streams its weights is also compared with the bandwidth it had (the `_then` fields).
_COPIES_AROUND = 3


def _impl_list(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    bad = [t for t in items if t not in IMPLS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {bad}; choose from {','.join(IMPLS)}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="bench_moe_layer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=positive_int_list, default=[8, 64, 256, 1024, 4096],
                   help="comma-separated expert counts E (default 8,64,256,1024,4096)")
    p.add_argument("--k", type=positive_int_list, default=[1, 2, 4],
                   help="comma-separated top-k values (default 1,2,4)")
    p.add_argument("--impls", type=_impl_list, default=list(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--tokens", type=positive_int, default=2048, help="tokens N per step (per rank; default 2048)")
    p.add_argument("--d", type=positive_int, default=256, help="model dim D (default 256)")
    p.add_argument("--h", type=positive_int, default=512, help="expert hidden width F (default 512)")
    p.add_argument("--capacity-factor", type=positive_float, default=1.0, help="capacity modes (default 1.0)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed steps at least (default 3)")
    p.add_argument("--min-time", type=non_negative_float, default=1.0,
                   help="... and more until they add up to this many seconds (default 1.0; 0: exactly --repeats)")
    p.add_argument("--warmup", type=positive_int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--ranks", type=positive_int, default=1,
                   help="1: the single-process sweep; R > 1: moe_scale's layer on R gloo ranks, ep_size R")
    p.add_argument("--a2a-chunks", type=positive_int_list, default=[1],
                   help="--ranks R > 1: each exchange in C overlapped pieces, one row per value (e.g. 1,2)")
    p.add_argument("--threads", type=positive_int, help="torch threads (default: torch's choice)")
    p.add_argument("--no-memory", action="store_true", help="skip the working-memory child process")
    p.add_argument("--gate-logit-std", type=non_negative_float, default=0.0,
                   help="draw the gating matrices so the logits have this std, as a trained router's spread "
                        "(default 0: zero-initialised gates, the paper's App. A; DeepSpeed keeps nn.Linear's init)")
    p.add_argument("--force-balanced-routing", action="store_true",
                   help="moe_scale's layers (dropless, capacity): the router runs, the tokens go to the experts "
                        "round-robin, as published Megatron/NeMo MoE throughputs are measured")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the layers run (default cpu)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="parameters and activations (default float32; bfloat16 on GPUs)")
    p.add_argument("--peak-tflops", type=positive_float, help="the roofline's matmul peak (default: measured on "
                   "CPU, the datasheet on a GPU)")
    p.add_argument("--peak-gbs", type=positive_float, help="the roofline's memory bandwidth in GB/s (default: "
                   "measured on CPU, the datasheet on a GPU)")
    p.add_argument("--out", type=Path, help="also write the JSON lines here")
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if any(k > e for e in args.experts for k in args.k):
        p.error(f"every --k must be <= every --experts (got k={args.k}, experts={args.experts})")
    if args.ranks > 1 and any(e % args.ranks for e in args.experts):
        p.error(f"--ranks {args.ranks} must divide every --experts value (got {args.experts})")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device here; run on a GPU machine or leave --device out")
        if args.ranks > 1:
            p.error("--ranks runs gloo processes on CPU; on a GPU compare layers in one process (--ranks 1)")
    unbalanced = [impl for impl in args.impls if impl not in BALANCEABLE]
    if args.force_balanced_routing and unbalanced:
        p.error(f"--force-balanced-routing applies to moe_scale's layers ({', '.join(BALANCEABLE)}), not to "
                f"{', '.join(unbalanced)}; pass --impls {','.join(BALANCEABLE)}")
    check_out_file(p, args.out)
    return args


# ---------------------------------------------------------------- the implementations


def _init_single_process_dist(device: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        init_deepspeed_comm("nccl" if device == "cuda" else "gloo", verbose=False)


def _ffn(d: int, h: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, h, bias=False), nn.ReLU(), nn.Linear(h, d, bias=False))


class _Dense(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.ffn = _ffn(d, h)

    def forward(self, x):
        return self.ffn(x), x.new_zeros(())


class _DeepSpeedLayer(nn.Module):
    def __init__(self, d, h, e, k, capacity_factor, drop_tokens):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(hidden_size=d, expert=_ffn(d, h), num_experts=e, ep_size=1, k=k,
                       capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor, min_capacity=0,
                       drop_tokens=drop_tokens, use_rts=False)
        self.moe.set_deepspeed_parallelism()

    def forward(self, x):
        y, aux, _ = self.moe(x)
        return y, aux


class _NaiveLoopLayer(nn.Module):
    """A naive sort-and-loop MoE layer (the issue quotes one at about 12% of its roofline at E=4096, k=2):
    moe_scale's router, then the (token, expert) pairs sorted by expert and a Python loop over the experts,
    each an nn.Sequential FFN of its own applied to its tokens' rows; one index_add sums the gated outputs."""

    def __init__(self, d, h, e, k):
        super().__init__()
        from moe_scale.moe.router import NoisyTopKRouter

        self.router = NoisyTopKRouter(d, e, k)
        self.experts = nn.ModuleList(_ffn(d, h) for _ in range(e))

    def forward(self, x_ND):
        route = self.router(x_ND)
        token_C, expert_C, gate_C = route.pairs()
        order_C = torch.argsort(expert_C, stable=True)
        token_C, gate_C = token_C[order_C], gate_C[order_C]
        outputs, start = [], 0
        for expert, count in zip(self.experts, torch.bincount(expert_C, minlength=len(self.experts)).tolist()):
            if count:
                rows = slice(start, start + count)
                outputs.append(expert(x_ND[token_C[rows]]) * gate_C[rows, None])
                start += count
        return x_ND.new_zeros(x_ND.shape).index_add(0, token_C, torch.cat(outputs)), route.aux_loss


def build(impl: str, e: int, k: int, args) -> nn.Module:
    """The layer made on --device (on a GPU its weights are drawn there: E = 256 at d = 1024, h = 4096 is 8.6 GB
    in float32, minutes through host memory), then cast to --dtype there."""
    with torch.device(args.device):
        layer = _build(impl, e, k, args)
    return layer.to(DTYPES[args.dtype])


def _build(impl: str, e: int, k: int, args) -> nn.Module:
    torch.manual_seed(args.seed)
    d, h = args.d, args.h
    if impl == "dense":
        return _Dense(d, dense_hidden(e, k, args))
    if impl == "naive_loop":
        layer = _NaiveLoopLayer(d, h, e, k)
        _spread_gate_logits(layer, args)
        return layer
    if impl.startswith("deepspeed"):
        _init_single_process_dist(args.device)
        layer = _DeepSpeedLayer(d, h, e, k, args.capacity_factor, drop_tokens=impl == "deepspeed_capacity")
        _spread_gate_logits(layer, args)
        return layer
    from moe_scale.moe.layer import MoELayer

    layer = MoELayer(moe_config(e, k, impl, args), d, seed=args.seed)
    _spread_gate_logits(layer, args)
    return layer


def moe_config(e: int, k: int, mode: str, args):
    """moe_scale's layer as the benchmark sets it: E experts of width --h, top-k, dispatch `mode`."""
    from moe_scale.config import MoEConfig

    config = MoEConfig()
    config.experts.num_experts, config.experts.hidden, config.router.top_k = e, args.h, k
    config.dispatch.mode, config.dispatch.capacity_factor = mode, args.capacity_factor
    config.router.force_balanced_routing = args.force_balanced_routing
    return config


def chunked(config, chunks: int):
    config.dispatch.a2a_chunks = chunks
    return config


def _spread_gate_logits(layer: nn.Module, args) -> None:
    """--gate-logit-std S: N(0, S^2 / D) gating matrices give logits of std S on the N(0, 1) inputs. Some of the
    gate's arithmetic costs more once logits spread (see cpu_gating.c), which a zero-initialised gate hides."""
    if args.gate_logit_std > 0:
        with torch.no_grad():
            for name, weight in layer.named_parameters():
                if name.endswith(("router.w_gate", "router.w_noise", "gate.wg.weight")):
                    weight.normal_(0.0, args.gate_logit_std / args.d ** 0.5)


def dense_hidden(e: int, k: int, args) -> int:
    return k * args.h + 2 * e


def expert_params(impl: str, e: int, k: int, args) -> int:
    if impl == "dense":
        return 2 * args.d * dense_hidden(e, k, args)
    return e * 2 * args.d * args.h


def forward_macs(impl: str, e: int, k: int, args) -> int:
    n, d, h = args.tokens, args.d, args.h
    if impl == "dense":
        return n * 2 * d * dense_hidden(e, k, args)
    return n * k * 2 * d * h + router_macs(impl, e, args)


def router_macs(impl: str, e: int, args) -> int:
    """The gating matrices' forward multiply-adds (DeepSpeed's gate has one matrix, ours two; none: dense)."""
    if impl == "dense":
        return 0
    gate_matrices = 1 if impl.startswith("deepspeed") else 2
    return gate_matrices * args.tokens * args.d * e


def experts_used(layer: nn.Module) -> int | None:
    """How many experts the last step sent tokens to: those whose weight gradient is not all zeros (an expert
    that no token reached gets exact zeros in every implementation). None for the dense FFN."""
    if isinstance(layer, _Dense):
        return None
    if isinstance(layer, _DeepSpeedLayer):
        return _modules_with_gradient(layer.moe.deepspeed_moe.experts.deepspeed_experts)
    if isinstance(layer, _NaiveLoopLayer):
        return _modules_with_gradient(layer.experts)
    reached_E = torch.zeros(layer.experts.w_in.shape[0], dtype=torch.bool,   # ours: stacked [E, F, D] weights
                            device=layer.experts.w_in.device)
    for weight in (layer.experts.w_in, layer.experts.w_out):
        if weight.grad is not None:
            reached_E |= weight.grad.flatten(1).ne(0).any(1)
    return int(reached_E.sum())


def _modules_with_gradient(experts: nn.ModuleList) -> int:
    return sum(any(p.grad is not None and bool(p.grad.ne(0).any()) for p in expert.parameters())
               for expert in experts)


def step(layer: nn.Module, x: torch.Tensor, probe: torch.Tensor) -> None:
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    y, aux = layer(x)
    # The gradient of the loss (y * probe).sum() + aux, fed straight in: the step times the layer's forward and
    # backward only, not a loss's [tokens, d] product and its backward (0.6-1.5 ms here, every layer alike).
    outputs, grads = ([y, aux], [probe, torch.ones_like(aux)]) if aux.requires_grad else ([y], [probe])
    torch.autograd.backward(outputs, grads)


def make_inputs(args) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    like = {"device": args.device, "dtype": DTYPES[args.dtype]}
    x = torch.randn(args.tokens, args.d, generator=gen).to(**like).requires_grad_(True)
    return x, torch.randn(args.tokens, args.d, generator=gen).to(**like)


# ---------------------------------------------------------------- machine peaks


def measure_peaks(args) -> tuple[float, float]:
    """(matmul FLOP/s, memory bytes/s): --peak-tflops / --peak-gbs where given; on a GPU its datasheet's; on
    CPU the best of a few tries each, after an untimed one."""
    if args.device == "cuda" or (args.peak_tflops and args.peak_gbs):
        return gpu_peaks(args)
    flops, bandwidth = cpu_peaks()
    return ((args.peak_tflops * 1e12 if args.peak_tflops else flops),
            (args.peak_gbs * 1e9 if args.peak_gbs else bandwidth))


def gpu_peaks(args) -> tuple[float, float]:
    from moe_scale.metrics.perf import table_peak_gbs, table_peak_tflops

    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    tflops = args.peak_tflops or table_peak_tflops(name, DTYPES[args.dtype] != torch.float32)
    gbs = args.peak_gbs or table_peak_gbs(name)
    if tflops is None or gbs is None:
        raise SystemExit(f"bench_moe_layer.py: error: no datasheet peaks for {name!r}; pass --peak-tflops and "
                         f"--peak-gbs")
    return tflops * 1e12, gbs * 1e9


def cpu_peaks() -> tuple[float, float]:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    c = torch.empty(2048, 2048)
    torch.mm(a, b, out=c)   # untimed: MKL's first product after a pause can run slower
    flops = []
    for _ in range(8):   # 8 tries each: a shared machine's single products varied by 25%, its copies by 2x
        start = time.perf_counter()
        torch.mm(a, b, out=c)
        flops.append(2 * 2048**3 / (time.perf_counter() - start))
    return max(flops), max(copy_bandwidths(8))


def copy_bandwidths(tries: int) -> list[float]:
    """Bytes/s of `tries` 256 MiB copies (bytes read plus written, as STREAM counts them), after an untimed one."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    bandwidths = []
    for _ in range(tries):
        start = time.perf_counter()
        dst.copy_(src)
        bandwidths.append(2 * src.numel() * 4 / (time.perf_counter() - start))
    return bandwidths


# ---------------------------------------------------------------- memory (child process)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _expert_weights(layer: nn.Module) -> list[nn.Parameter]:
    """The weights whose size the working memory leaves out: the experts' (the dense FFN's own)."""
    if isinstance(layer, _Dense):
        return list(layer.parameters())
    if isinstance(layer, _DeepSpeedLayer):
        return list(layer.moe.deepspeed_moe.experts.parameters())
    return list(layer.experts.parameters())


def working_memory_child(args) -> None:
    """Prints one JSON line per implementation: working memory of one step in MiB.

    The expert weights are frozen for the measured step, so their gradients are never allocated: the peak
    above the memory before the step is then the step's working memory (activations, router and input
    gradients, dispatch buffers) without the expert weights and their gradients, as the target defines it."""
    x, probe = make_inputs(args)
    for e in args.experts:
        for k in args.k:
            for impl in args.impls:
                layer = build(impl, e, k, args)
                for weight in _expert_weights(layer):
                    weight.requires_grad_(False)
                step(layer, x, probe)                  # warm-up: lazy allocations, DeepSpeed's caches
                for p in layer.parameters():
                    p.grad = None
                x.grad = None
                gc.collect()
                before_kb = _status_kb("VmRSS")
                Path("/proc/self/clear_refs").write_text("5")   # reset the peak (VmHWM) to the current RSS
                step(layer, x, probe)
                working = (_status_kb("VmHWM") - before_kb) / 1024
                print(json.dumps({"impl": impl, "experts": e, "k": k, "working_mib": round(working, 1)}), flush=True)
                del layer
                gc.collect()


def measure_working_memory(args) -> dict[tuple[str, int, int], dict]:
    """One fresh child process per (implementation, E, k): memory freed by an earlier measurement cannot
    hide in the next one's baseline."""
    results = {}
    for e in args.experts:
        for k in args.k:
            for impl in args.impls:
                cmd = [sys.executable, __file__, "--memory-child", "--experts", str(e), "--k", str(k), "--impls", impl,
                       "--tokens", str(args.tokens), "--d", str(args.d), "--h", str(args.h),
                       "--capacity-factor", str(args.capacity_factor), "--seed", str(args.seed),
                       "--gate-logit-std", str(args.gate_logit_std),
                       *(["--force-balanced-routing"] if args.force_balanced_routing else [])]
                env = {**os.environ, _MMAP_ENV: "65536", "MASTER_PORT": str(free_port())}
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(f"bench_moe_layer.py: error: the memory child for {impl} E={e} k={k} failed "
                                     f"(status {proc.returncode}):\n{proc.stderr[-3000:]}")
                row = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
                results[(impl, e, k)] = row
    return results


# ---------------------------------------------------------------- the sweep


def timed_steps(one_step: Callable[[], float], args, all_agree: Callable[[bool], bool] = bool) -> list[float]:
    """The seconds of timed steps (`one_step` runs one and returns its time), after --warmup untimed ones: at
    least --repeats, and more until they add up to --min-time (why: tools/README.md). `all_agree(more)`:
    every rank's decision, so that ranks stepping together stop together."""
    for _ in range(args.warmup):
        one_step()
    times = []
    while all_agree(len(times) < args.repeats or sum(times) < args.min_time):
        times.append(one_step())
    return times


def time_impl(impl: str, e: int, k: int, args, x, probe) -> tuple[list[float], int | None]:
    """(the timed steps' seconds, experts_used after the last) of a freshly built layer, freed before the next
    is built."""
    layer = build(impl, e, k, args)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    times = _time_layer(layer, args, x, probe)
    used = experts_used(layer)
    del layer
    gc.collect()
    return times, used


def _time_layer(layer: nn.Module, args, x, probe) -> list[float]:
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def one_step() -> float:
        sync()
        start = time.perf_counter()
        step(layer, x, probe)
        sync()
        return time.perf_counter() - start

    return timed_steps(one_step, args)


def sweep(args) -> list[dict]:
    cuda = args.device == "cuda"
    memory = {} if args.no_memory or cuda else measure_working_memory(args)
    x, probe = make_inputs(args)
    peak_flops = peak_bandwidth = 0.0
    rows = []
    for e in args.experts:
        for k in args.k:
            flops, bandwidth = measure_peaks(args)
            peak_flops, peak_bandwidth = max(peak_flops, flops), max(peak_bandwidth, bandwidth)
            samples, used, bandwidth_then = {}, {}, {}
            for impl in args.impls:
                too_big = _does_not_fit(impl, e, k, args)
                if too_big:
                    emit({"impl": impl, "experts": e, "k": k, "tokens": args.tokens, "d": args.d, "h": args.h,
                          "dtype": args.dtype, "device": args.device, "skipped": too_big}, args.out)
                    continue
                if cuda and not args.no_memory:
                    memory[(impl, e, k)] = {"working_mib": cuda_working_memory(impl, e, k, args, x, probe)}
                before = [] if cuda else copy_bandwidths(_COPIES_AROUND)   # the bandwidth while this layer ran
                samples[impl], used[impl] = time_impl(impl, e, k, args, x, probe)
                bandwidth_then[impl] = None if cuda else statistics.median(before + copy_bandwidths(_COPIES_AROUND))
            times = {impl: statistics.median(seconds) for impl, seconds in samples.items()}
            for impl in samples:
                rows.append(_row(impl, e, k, args, times, len(samples[impl]), memory, peak_flops, peak_bandwidth,
                                 used[impl], bandwidth_then[impl]))
                emit(rows[-1], args.out)
    return rows


def _does_not_fit(impl: str, e: int, k: int, args) -> str | None:
    """Why a configuration cannot run on this GPU (its expert weights, their gradients and a copy of each in
    the optimizer-free step: 2 x weights), or None."""
    if args.device != "cuda":
        return None
    need = 2 * expert_params(impl, e, k, args) * DTYPES[args.dtype].itemsize
    free, _ = torch.cuda.mem_get_info()
    if need > 0.9 * free:
        return f"expert weights and gradients need {need / 2**30:.1f} GiB; {free / 2**30:.1f} GiB free"
    return None


def cuda_working_memory(impl: str, e: int, k: int, args, x, probe) -> float:
    """MiB the CUDA allocator's peak rose above the memory before one step, the expert weights frozen."""
    layer = build(impl, e, k, args)
    for weight in _expert_weights(layer):
        weight.requires_grad_(False)
    step(layer, x, probe)                  # warm-up: lazy allocations
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(layer, x, probe)
    torch.cuda.synchronize()
    working = (torch.cuda.max_memory_allocated() - before) / 2**20
    x.grad = None
    del layer
    gc.collect()
    torch.cuda.empty_cache()
    return round(working, 1)


def _row(impl, e, k, args, times, steps, memory, peak_flops, peak_bandwidth, used: int | None,
         bandwidth_then: float | None = None) -> dict:
    """One JSON row; `used`: experts_used (None: every weight is read, as the dense FFN's); `bandwidth_then`:
    the copies' bandwidth around this layer's steps, for the `_then` fields."""
    flops = 6 * forward_macs(impl, e, k, args)
    weight_bytes = DTYPES[args.dtype].itemsize * expert_params(impl, e, k, args)
    read_bytes = weight_bytes if used is None else weight_bytes * used / e
    moved_bytes = WEIGHT_READS * read_bytes + weight_bytes   # + the gradients written
    compute_s, memory_s = flops / peak_flops, moved_bytes / peak_bandwidth
    roofline_s = max(compute_s, memory_s)
    # The router's products, then the experts: the best schedule that does not split the cores between them.
    router_s = 6 * router_macs(impl, e, args) / peak_flops
    serial_s = router_s + max(compute_s - router_s, memory_s)
    t = times[impl]
    row = {"impl": impl, "experts": e, "k": k, "tokens": args.tokens, "d": args.d, "h": args.h,
           "gate_logit_std": args.gate_logit_std, "force_balanced_routing": args.force_balanced_routing,
           "device": args.device, "dtype": args.dtype, "time_s": sig(t), "steps": steps,
           "roofline_s": sig(roofline_s), "roofline_fraction": sig(roofline_s / t),
           "bound": "compute" if compute_s >= memory_s else "memory",
           "roofline_gflop": sig(flops / 1e9), "roofline_gbytes": sig(moved_bytes / 1e9),
           "matmul_peak_gflops": round(peak_flops / 1e9, 1), "bandwidth_gbs": round(peak_bandwidth / 1e9, 2),
           "serial_bound_s": sig(serial_s), "serial_ceiling": sig(roofline_s / serial_s),
           "serial_fraction": sig(serial_s / t)}
    if used is not None:
        row["experts_used"] = used
    if bandwidth_then is not None:
        roofline_then_s = max(compute_s, moved_bytes / bandwidth_then)
        row["bandwidth_then_gbs"] = round(bandwidth_then / 1e9, 2)
        row["roofline_fraction_then"] = sig(roofline_then_s / t)
    reference = {"dropless": "deepspeed_dropless", "capacity": "deepspeed_capacity"}.get(impl)
    if reference in times:
        row["speedup_vs_deepspeed"] = round(times[reference] / t, 2)
    if "dense" in times and impl != "dense":
        row["time_vs_dense"] = round(t / times["dense"], 2)
    mem = memory.get((impl, e, k))
    if mem:
        row["working_mib"] = mem["working_mib"]
        dense_mem = memory.get(("dense", e, k))
        if dense_mem and impl != "dense":
            row["working_vs_dense"] = round(mem["working_mib"] / max(dense_mem["working_mib"], 1e-9), 2)
    return row


# ---------------------------------------------------------------- several ranks


def _rank_worker(rank: int, world: int, port: int, args, queue) -> None:
    import torch.distributed as dist

    from moe_scale.moe.layer import MoELayer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    init_deepspeed_comm("gloo", verbose=False)
    x, probe = make_inputs(argparse.Namespace(**{**vars(args), "seed": args.seed + rank}))
    for e in args.experts:
        for k in args.k:
            for mode, chunks in [(m, c) for m in args.impls if m in ("dropless", "capacity") for c in args.a2a_chunks]:
                layer = MoELayer(chunked(moe_config(e, k, mode, args), chunks), args.d, ep_size=world, ep_rank=rank,
                                 seed=args.seed)
                torch.manual_seed(args.seed)   # the same router on every rank
                _spread_gate_logits(layer, args)
                layer.set_deepspeed_parallelism()
                times, shares = _time_ranked_layer(layer, args, x, probe)
                if rank == 0:
                    queue.put({"impl": mode, "ranks": world, "ep_size": world, "a2a_chunks": chunks,
                               "experts": e, "k": k,
                               "tokens_per_rank": args.tokens, "d": args.d, "h": args.h,
                               "gate_logit_std": args.gate_logit_std,
                               "force_balanced_routing": args.force_balanced_routing,
                               "time_s": sig(statistics.median(times)),
                               "steps": len(times), "all_to_all_share": round(statistics.median(shares), 3)})
                del layer
    queue.put(None) if rank == 0 else None
    dist.destroy_process_group()   # left up after an all_reduce, gloo aborted the rank at exit (status -6)


def _time_ranked_layer(layer, args, x, probe) -> tuple[list[float], list[float]]:
    """(seconds, all-to-all share) of each timed step, the ranks starting every step together."""
    import torch.distributed as dist

    timer = layer.dispatcher.timer
    shares = []

    def one_step() -> float:
        dist.barrier()
        timer.reset()
        start = time.perf_counter()
        step(layer, x, probe)
        seconds = time.perf_counter() - start
        shares.append(timer.seconds / seconds)
        return seconds

    times = timed_steps(one_step, args, _any_rank_wants_more)
    return times, shares[args.warmup:]


def _any_rank_wants_more(more: bool) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([int(more)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def multi_rank(args) -> None:
    for row in spawned_ranks(_rank_worker, args.ranks, args, "bench_moe_layer.py"):
        emit(row, args.out)


def main(argv: list[str] | None = None) -> None:
    apply_process_settings()   # as the moe-scale command does: THP and freed memory kept
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        working_memory_child(args)
    elif args.ranks > 1:
        multi_rank(args)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
