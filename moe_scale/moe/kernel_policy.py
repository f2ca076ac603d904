"""Which kernels the MoE layer runs, decided by the device its tensors live on.

    CPU   float32 products and the noisy gate on the native C kernels (moe/cpu_backend/cpu_kernels.c) where they are
          built; other dtypes on torch's grouped GEMM; the gate's [tokens, experts] arithmetic in row chunks
          (it stays in cache).
    GPU   grouped GEMMs (torch's F.grouped_mm, DeepSpeed's Triton kernel, see moe/experts/grouped_gemm.py), at most
          1,023 experts per call (the CUTLASS kernel's limit); the gate as whole-tensor ops, so the number
          of kernels launched depends on neither the number of tokens nor the number of experts.

`gpu_decisions()` makes CPU tensors take the GPU's decisions (its grouped-GEMM kernel excepted, which needs
CUDA: torch's grouped GEMM runs in its place with the same chunking), so tools/count_ops.py and the tests
can count, on a machine without a GPU, the operations and host synchronisations a GPU step dispatches.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelPolicy:
    native_cpu: bool              # cpu_kernels.c for float32 CPU tensors (where built)
    gate_chunk_rows: int | None   # the gate's torch path works on this many rows at a time (None: all)
    max_groups: int | None        # experts per grouped-GEMM call (None: all)


CPU = KernelPolicy(native_cpu=True, gate_chunk_rows=256, max_groups=None)
GPU = KernelPolicy(native_cpu=False, gate_chunk_rows=None, max_groups=1023)
_forced: list[KernelPolicy] = []


def policy_for(t: torch.Tensor) -> KernelPolicy:
    if _forced:
        return _forced[-1]
    return CPU if t.device.type == "cpu" else GPU


@contextlib.contextmanager
def forced_policy(policy: KernelPolicy):
    """Within this block every tensor takes `policy`'s decisions (tests, tools/count_ops.py)."""
    _forced.append(policy)
    try:
        yield
    finally:
        _forced.pop()


def gpu_decisions():
    """Within this block CPU tensors take the GPU's kernel decisions (see the module docstring)."""
    return forced_policy(GPU)


def count_per_bin(index: torch.Tensor, num_bins: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """How often each of 0..num_bins-1 occurs in `index`, on the device: a scatter-add. (CUDA's bincount reads
    the input's min and max to the host first, even with minlength; this never waits for the GPU.)"""
    flat = index.reshape(-1)
    return torch.zeros(num_bins, dtype=dtype, device=index.device).index_add_(
        0, flat, _one(index.device, dtype).expand(flat.shape[0]))


@functools.lru_cache(maxsize=None)
def _one(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 1 on the device, made once (read only: the counts add it, expanded): no fill launched per count."""
    return torch.ones((), dtype=dtype, device=device)
