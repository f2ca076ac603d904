#!/usr/bin/env python
"""tools/gpu_check.sh's first stage: the device and the imports, each timed; exits 2 at the first that fails.

    python tools/gpu_env.py OUT.json      # REHEARSE=1: no CUDA device needed

GPU_CHECK_REQUIRED (default: torch deepspeed datasets moe_scale, what every later stage needs), torch first and
then (unless REHEARSE=1) a CUDA device; then GPU_CHECK_OPTIONAL (default: triton transformers tokenizers: reported,
not required). REHEARSE=1 also compiles what CPU runs build on first use (GPU_CHECK_WARM=0: not). One JSON
object, written to OUT.json and printed: versions, seconds per import, the device's name, compute capability,
memory, CUDA and NCCL versions, whether F.grouped_mm is there; `missing` names a failed import and `error` says
what stopped the check.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

REQUIRED = "torch deepspeed datasets moe_scale"
OPTIONAL = "triton transformers tokenizers"


def timed_import(name: str, info: dict) -> bool:
    start = time.perf_counter()
    try:
        module = importlib.import_module(name)
    except Exception as e:   # noqa: BLE001 - any failure to import is the finding
        info["imports"][name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{name}: FAILED ({type(e).__name__}: {e})", flush=True)
        return False
    seconds = round(time.perf_counter() - start, 2)
    info["imports"][name] = {"version": str(getattr(module, "__version__", "")), "seconds": seconds,
                             "file": getattr(module, "__file__", None)}
    print(f"{name} {info['imports'][name]['version']} ({seconds} s) {module.__file__}", flush=True)
    return True


def device_info(torch) -> dict:
    import torch.nn.functional as F

    info = {"cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
            "grouped_mm": hasattr(F, "grouped_mm")}
    if info["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count, device_count=torch.cuda.device_count(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
        torch.ones(1, device="cuda").add_(1).item()   # a context and one kernel: the driver answers
    return info


def warm_cpu_builds(info: dict) -> None:
    """REHEARSE=1: what a CPU run compiles on first use (moe_scale's native kernels, a few seconds into a new work
    directory; DeepSpeed's CPU communication op is never built: distributed/launch.py's init_deepspeed_comm), built
    here so that the later stages' limits time the stages. A GPU run builds nothing."""
    import torch

    from moe_scale.moe.cpu_backend import kernels

    start = time.perf_counter()
    info["native_kernels"] = kernels.available(torch.empty(0))
    info["cpu_builds_seconds"] = round(time.perf_counter() - start, 1)
    print(f"CPU builds: {info['cpu_builds_seconds']} s", flush=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("gpu_env.py: error: give the JSON file to write", file=sys.stderr)
        return 2
    rehearse = os.environ.get("REHEARSE") == "1"
    info = {"python": platform.python_version(), "executable": sys.executable, "rehearse": rehearse, "imports": {}}
    required = os.environ.get("GPU_CHECK_REQUIRED", REQUIRED).split()
    optional = os.environ.get("GPU_CHECK_OPTIONAL", OPTIONAL).split()
    error = None
    if "torch" not in required or timed_import("torch", info):
        if "torch" in required:
            info.update(device_info(sys.modules["torch"]))
            if not rehearse and not info["cuda_available"]:
                error = "no CUDA device (torch.cuda.is_available() is False); REHEARSE=1 runs the check on the CPU"
        for name in [] if error else [n for n in required if n != "torch"]:
            if not timed_import(name, info):
                error = f"{name} does not import"
                break
    else:
        error = "torch does not import"
    if error is None:
        for name in optional:
            timed_import(name, info)
        if rehearse and {"deepspeed", "moe_scale"} <= set(required) and os.environ.get("GPU_CHECK_WARM") != "0":
            warm_cpu_builds(info)
    info["missing"] = [n for n, v in info["imports"].items() if "error" in v and n in required]
    info["error"] = error
    Path(argv[0]).write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k != "imports"}), flush=True)
    if error:
        print(f"gpu_env.py: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
