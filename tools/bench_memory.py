#!/usr/bin/env python
"""Peak memory per process of Shazeer et al. App. D's options on a ~thousand-expert LSTM-MoE.

Four configurations, each in its own fresh process (so each peak is its own): baseline (AdamW, experts'
hidden activations stored), recompute (--expert-recompute), factored (--optimizer factored), both.
Each process builds the model, runs --steps training steps (forward, backward, optimizer step) on random
tokens, and reports what it measured:

  peak_rss_mb             the process's peak resident memory (ru_maxrss; includes Python and torch, see
                          rss_before_model_mb; large allocations are mmap'd so that freed memory leaves
                          RSS) — on --device cuda, peak_device_mb is torch's peak allocation
  params_mb, grads_mb     parameter and gradient bytes
  optimizer_state_mb      bytes held in the optimizer's state after the steps; expert_optimizer_state_mb the
                          part for expert matrices
  saved_for_backward_mb   bytes of the distinct tensor storages, other than parameters, that autograd saved
                          for the backward pass during one forward (what --expert-recompute cuts)
  step_seconds            mean wall time of a step after the first

One JSON line per configuration on stdout (and in --out), then one summary line with the ratios.

    python tools/bench_memory.py                       # 1024 experts, d=128, h=512, 4096 tokens per step
    python tools/bench_memory.py --experts 1024 --d 512 --h 1024 --device cuda   # the paper's expert size
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from tool_args import OneLineParser, positive_int

# glibc keeps freed heap memory mapped, so the peak RSS of a process that frees and reallocates large tensors
# depends on fragmentation. Serving every allocation over 64 KiB by mmap (returned to the OS when freed)
# makes ru_maxrss follow the peak of live memory.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}

CONFIGS = {"baseline": (False, "adam"), "recompute": (True, "adam"), "factored": (False, "factored"),
           "both": (True, "factored")}


def parse_args(argv=None):
    p = OneLineParser(prog="bench_memory.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=positive_int, default=1024, help="experts E (default 1024)")
    p.add_argument("--top-k", type=positive_int, default=4, help="experts per token (default 4, as the paper)")
    p.add_argument("--d", type=positive_int, default=128, help="model dim (default 128)")
    p.add_argument("--h", type=positive_int, default=512, help="expert hidden dim (default 512)")
    p.add_argument("--vocab", type=positive_int, default=2000, help="vocabulary size (default 2000)")
    p.add_argument("--batch", type=positive_int, default=128, help="sequences per step (default 128)")
    p.add_argument("--seq-len", type=positive_int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--steps", type=positive_int, default=2, help="training steps per process (default 2)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--out", type=Path, help="also write the JSON lines here")
    p.add_argument("--one", help=argparse.SUPPRESS)   # internal: measure one configuration in this process
    args = p.parse_args(argv)
    bad = [c for c in args.configs.split(",") if c not in CONFIGS]
    if bad:
        p.error(f"unknown configuration(s) {bad}; choose from {', '.join(CONFIGS)}")
    return args


def _mb(numel_bytes: float) -> float:
    return round(numel_bytes / 2**20, 3)


def measure_one(args, name: str) -> dict:
    """Runs in the child process: build, train --steps steps, measure."""
    import torch

    from moe_scale.config import RunConfig, TrainConfig
    from moe_scale.models.lstm_lm import LSTMMoELM
    from moe_scale.train.engine import optimizer_groups
    from moe_scale.train.factored_optimizer import build_optimizer, optimizer_state_numel

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    recompute, optimizer_name = CONFIGS[name]
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = RunConfig.from_settings(d_model=args.d, expert_hidden=args.h, num_experts=args.experts,
                                     top_k=args.top_k, dropout=0.0, expert_recompute=recompute)
    model = LSTMMoELM(config, args.vocab, seed=0).to(device).train()
    optimizer = build_optimizer(optimizer_groups(model), TrainConfig(optimizer=optimizer_name, lr=1e-3))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    saved: dict[int, int] = {}
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):   # distinct storages; parameters saved for backward cost no extra memory
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    times = []
    for step in range(args.steps):
        inputs = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
        targets = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
        began = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(inputs, targets)
            saved_bytes = sum(saved.values())
            saved.clear()
        (out.nll_sum / out.num_tokens + out.aux_loss).backward()
        optimizer.step()
        grads_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    expert_numel = sum(p.numel() for p in model.moe.experts.parameters())
    result = {
        "config": name, "expert_recompute": recompute, "optimizer": optimizer_name, "experts": args.experts,
        "top_k": args.top_k, "d": args.d, "h": args.h, "vocab": args.vocab,
        "tokens_per_step": args.batch * args.seq_len,
        "device": args.device, "expert_params_m": round(expert_numel / 1e6, 3),
        "params_mb": _mb(sum(p.numel() * p.element_size() for p in model.parameters())),
        "grads_mb": _mb(grads_bytes),
        "optimizer_state_mb": _mb(optimizer_state_numel(optimizer) * 4),
        "expert_optimizer_state_mb": _mb(sum(v.numel() * v.element_size() for p in model.moe.experts.parameters()
                                             for v in optimizer.state[p].values() if torch.is_tensor(v))),
        "saved_for_backward_mb": _mb(saved_bytes),
        "step_seconds": round(sum(times[1:]) / max(len(times) - 1, 1), 4),
        "rss_before_model_mb": _mb(rss_before),
        "peak_rss_mb": _mb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
    }
    if device.type == "cuda":
        result["peak_device_mb"] = _mb(torch.cuda.max_memory_allocated())
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args, args.one)))
        return 0
    forwarded = [f"--{flag.replace('_', '-')}={getattr(args, flag)}"
                 for flag in ("experts", "top_k", "d", "h", "vocab", "batch", "seq_len", "steps", "device")]
    lines = []
    for name in args.configs.split(","):
        proc = subprocess.run([sys.executable, __file__, *forwarded, "--one", name], capture_output=True, text=True,
                              env={**os.environ, **MALLOC_ENV})
        if proc.returncode:
            print(f"bench_memory.py: error: configuration {name} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        lines.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(lines[-1]), flush=True)
    by = {line["config"]: line for line in lines}
    summary = {"summary": True}
    base = by.get("baseline")
    factored = next((by[n] for n in ("factored", "both") if n in by), None)
    recomputed = next((by[n] for n in ("recompute", "both") if n in by), None)
    if base and factored and factored["expert_optimizer_state_mb"]:
        summary["expert_optimizer_state_reduction"] = round(
            base["expert_optimizer_state_mb"] / factored["expert_optimizer_state_mb"], 1)
    if base and recomputed:
        summary["saved_for_backward_reduction_mb"] = round(
            base["saved_for_backward_mb"] - recomputed["saved_for_backward_mb"], 3)
    for name, line in by.items():
        summary[f"peak_rss_mb_{name}"] = line["peak_rss_mb"]
    lines.append(summary)
    print(json.dumps(summary))
    if args.out:
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
