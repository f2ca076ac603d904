"""Host memory policy: freed blocks stay with the process for the next step instead of going back to the system.

torch's CPU allocator keeps no cache, so every step's activations are new allocations. glibc serves a large
one from fresh pages (above its mmap threshold, dynamic from 128 KiB, or after trimming its heap), and the
kernel zero-fills a fresh page on first touch, which made the MoE layer's step measurably slower
(docs/performance.md, "Host memory policy"). So moe_scale raises glibc's mmap threshold to 1 GiB and its trim
threshold to 2 GiB: what a GPU's caching allocator does. The resident set then stays near its peak between
steps. 1 GiB, not glibc's usual ceiling of 32 MiB, because the router's [tokens, experts] tensors pass 32 MiB
at thousands of experts. Blocks above 1 GiB are still mapped fresh (the expert weight gradients, the largest,
are reused by `moe.experts.GradientBuffers`); a glibc that refuses a threshold above 32 MiB gets 32 MiB.

Left alone: where the user set glibc's own malloc settings (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
MALLOC_TOP_PAD_, MALLOC_MMAP_MAX_, or malloc tunables in GLIBC_TUNABLES), as the memory benchmarks do to
measure live memory; off glibc; and with MOE_SCALE_KEEP_FREED_MEMORY=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3                     # glibc's mallopt parameters
_MMAP_THRESHOLDS = (2**30, 32 * 2**20)                            # wanted; the most an older glibc accepts
_TRIM_THRESHOLD = 2**31 - 1                                       # mallopt takes an int
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
OPT_OUT = "MOE_SCALE_KEEP_FREED_MEMORY"


def keep_freed_memory(environ: dict[str, str] | None = None) -> bool:
    """Applies the policy above; returns whether it did."""
    environ = os.environ if environ is None else environ
    if environ.get(OPT_OUT, "1") == "0" or any(name in environ for name in _USER_SETTINGS) \
            or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return any(libc.mallopt(_M_MMAP_THRESHOLD, threshold) for threshold in _MMAP_THRESHOLDS) and \
            bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    except (OSError, AttributeError):   # no libc to load, or one without mallopt: glibc's defaults stay
        return False


def apply_process_settings() -> None:
    """What the `moe-scale` command and the benchmarks do first, before torch allocates: transparent huge pages
    for torch's large CPU allocations (expert gradients are multi-GB tensors, and with 4 KiB pages every first
    write to a page faults; torch reads THP_MEM_ALLOC_ENABLE at its first allocation; a user's setting wins),
    and `keep_freed_memory`. A library user importing moe_scale gets neither unless they call this."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    keep_freed_memory()
