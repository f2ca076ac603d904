"""Per-expert products as grouped GEMMs: one call for all experts, whatever their number.

Legend (docs/shapes.md): M rows sorted by local expert (`counts_L[e]` of them for expert e), L local experts,
I input width, O output width (of a product), D model width.

Offsets are int32 row ends on the device, which is what grouped GEMMs read, so nothing here waits for the
device.

    rows_times_expert   out[rows of e] = a[rows of e] @ b[e]                 [M, I] x [L, I, O] -> [M, O]
    per_expert_outer    out[e] = a[rows of e].T @ b[rows of e]              [M, I] x [M, O] -> [L, I, O]
    row_dot             sum(a * b, dim=1)                                    [M, I] x [M, I] -> [M]

Kernels (`GroupLayout` picks one per layer from the device and dtype; tests force each in turn):

    native   cpu_kernels.c: CPU float32, register-tiled, each expert's weights streamed once
             (moe/cpu_backend/kernels.py)
    grouped  torch's F.grouped_mm. On CUDA its fast path is bfloat16 on compute capability 9.x/10.x (a CUTLASS
             kernel that takes at most 1,023 groups: more experts run as several calls); on CPU every dtype.
    triton   DeepSpeed's Triton grouped GEMM, on CUDA where F.grouped_mm has no fast path (float32, float16,
             A100 and older GPUs), with TF32 tensor cores for float32.
    loop     one matmul per expert: the last resort, announced by a one-line warning saying why.

Weight gradients take the token dimension as the strided (outer) one of both operands, so every expert's
rows start 16-byte aligned for any number of rows (no per-expert padding, which grouped GEMMs otherwise
need); D and H must be multiples of 8 for bfloat16 on the GPU.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from moe_scale.deepspeed_internals import triton_group_gemm, triton_grouped_dw, triton_grouped_gemm
from moe_scale.moe.cpu_backend import kernels as cpu_kernels
from moe_scale.moe.expert_counts import Counts, ExpertCounts
from moe_scale.moe.kernel_policy import policy_for

KERNELS = ("loop", "grouped", "triton", "native")


_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# F.grouped_mm (torch >= 2.10) or, on CUDA, the private op it wraps (torch 2.8 and 2.9)
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """[M, K] @ [G, K, N] (rows split by offsets) or [K, M] @ [M, N] -> [G, K, N] (reduction split): either
    way each element of `a` is multiplied with one row of N values of `b`, so 2 * |a| * N FLOPs."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def _register_flop_formula() -> None:
    """Lets torch's FlopCounterMode count grouped GEMMs (torch has no formula for them yet)."""
    if not hasattr(torch.ops.aten, "_grouped_mm"):
        return
    from torch.utils.flop_counter import flop_registry, register_flop_formula as register

    if torch.ops.aten._grouped_mm.default not in flop_registry:
        register(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


def kernel_for(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None, has_grouped_mm: bool,
               has_triton: bool) -> tuple[str, str]:
    """(kernel, why) for products on this device and dtype, the native CPU kernels aside; `why` says why a loop
    and what would avoid it."""
    if dtype not in _GROUPED_DTYPES:
        return "loop", "grouped GEMMs take float32, bfloat16 and float16: train in one of those"
    if device_type == "cpu":
        return ("grouped", "") if has_grouped_mm else ("loop", "this torch has no F.grouped_mm: install torch "
                                                               ">= 2.10")
    if has_grouped_mm and dtype == torch.bfloat16 and capability is not None and capability[0] in (9, 10):
        return "grouped", ""
    if has_triton:
        return "triton", ""
    return "loop", ("F.grouped_mm has no fast path for it here and Triton is not installed: install triton, or "
                    "train in bfloat16 on an H100-class GPU")


def choose_kernel(like: torch.Tensor) -> str:
    """The kernel for products of tensors like `like` (device and dtype)."""
    if cpu_kernels.available(like):
        return "native"
    cuda = like.device.type == "cuda"
    kernel, why = kernel_for(like.device.type, like.dtype, torch.cuda.get_device_capability(like.device) if cuda
                             else None, hasattr(F, "grouped_mm") or (cuda and _grouped_mm is not None),
                             cuda and triton_grouped_gemm() is not None)
    if kernel == "loop":
        _warn_loop(like.device.type, str(like.dtype).replace("torch.", ""), why)
    return kernel


@functools.cache
def _warn_loop(device: str, dtype: str, why: str) -> None:
    warnings.warn(f"moe_scale: grouped products (experts, hierarchical gates) run one matmul per group on {device} "
                  f"{dtype}; {why}", stacklevel=3)


class GroupLayout:
    """M rows sorted by expert, `counts[e]` of them for expert e, and the kernel every product uses.

    The counts on the host (the dispatcher reads them once for its all-to-all and passes both) are needed
    only to split more than `max_groups` experts into several calls, and by the loop kernel; without them
    those two read the device's counts themselves (a split needs only `BlockCounts` where blocks fit a call)."""

    def __init__(self, counts: Counts, like: torch.Tensor, kernel: str | None = None):
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel == "native" and not cpu_kernels.available(like):
            raise ValueError(f"kernel 'native' takes CPU float32 tensors and a built library; got "
                             f"{like.device.type} {like.dtype}")
        self.kernel = kernel or choose_kernel(like)
        counts = ExpertCounts.of(counts)
        self._blocks, self._host_counts = counts.blocks, counts.host
        self.counts_L = counts.device_L.to(device=like.device, dtype=torch.long)
        self.num_groups = self.counts_L.shape[0]
        self.offsets = self.counts_L.cumsum(0, dtype=torch.int32)   # row ends, what grouped GEMMs take
        if self.kernel == "native":
            self.offsets_L1 = torch.cat([self.counts_L.new_zeros(1), self.offsets.long()])
        max_groups = policy_for(like).max_groups
        self.chunks = self._chunks(max_groups) if self.kernel in ("grouped", "triton") and max_groups \
            and self.num_groups > max_groups else None

    @property
    def host_counts(self) -> list[int]:
        if self._host_counts is None:
            self._host_counts = self.counts_L.tolist()
        return self._host_counts

    def _chunks(self, max_groups: int) -> list[tuple[int, int, int, int, torch.Tensor]]:
        """(first expert, end expert, first row, end row, chunk-relative offsets) per call of at most
        `max_groups` experts."""
        blocks = self._blocks
        if self._host_counts is None and blocks is not None and max_groups >= blocks.block:
            # whole blocks per call: their host counts place every boundary, nothing is read from the device
            counts, unit = blocks.counts, blocks.block
        else:
            counts, unit = self.host_counts, 1
        step = max_groups // unit * unit
        chunks, row = [], 0
        for first in range(0, self.num_groups, step):
            end = min(first + step, self.num_groups)
            rows = sum(counts[first // unit:end // unit])
            chunks.append((first, end, row, row + rows, self.offsets[first:end] - row))
            row += rows
        return chunks


def rows_times_expert(a_MI: torch.Tensor, b_LIO: torch.Tensor, layout: GroupLayout,
                      a_index_M: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ b[e]: [M, O]. With `a_index_M`, row r reads a[a_index_M[r]] (the native
    kernel gathers as it reads; the others gather first); `relu` clamps the result at 0."""
    if layout.kernel == "native":   # b is a weight [L, I, O] or a weight's transpose
        if b_LIO.transpose(1, 2).is_contiguous():
            return cpu_kernels.rows_times_wt(a_MI, b_LIO.transpose(1, 2), layout.offsets_L1, a_index_M, relu)
    if a_index_M is not None:
        a_MI = a_MI.index_select(0, a_index_M)
    if layout.kernel == "native":
        out_MO = cpu_kernels.rows_times_w(a_MI, b_LIO, layout.offsets_L1)
    elif a_MI.shape[0] == 0:
        out_MO = a_MI.new_empty(0, b_LIO.shape[2])
    elif layout.kernel in ("grouped", "triton"):
        product = _grouped_rows if layout.kernel == "grouped" else _triton_rows
        if layout.chunks is None:
            out_MO = product(a_MI, b_LIO, layout.offsets)
        else:
            out_MO = torch.cat([product(a_MI[r0:r1], b_LIO[e0:e1], offsets)
                                for e0, e1, r0, r1, offsets in layout.chunks])
    else:
        out_MO = a_MI.new_empty(a_MI.shape[0], b_LIO.shape[2])
        start = 0
        for e, count in enumerate(layout.host_counts):
            if count:
                torch.mm(a_MI[start:start + count], b_LIO[e], out=out_MO[start:start + count])
                start += count
    return out_MO.relu_() if relu else out_MO


def per_expert_outer(a_MI: torch.Tensor, b_MO: torch.Tensor, layout: GroupLayout,
                     out: tuple[torch.Tensor, bool] | None = None,
                     b_index_M: torch.Tensor | None = None) -> torch.Tensor:
    """out[e] = a[rows of e].T @ b[rows of e]: [L, I, O], exact zeros for an expert with no rows. With
    `b_index_M`, row r of b is b[b_index_M[r]]. `out` (native kernel only): a buffer to write over, and
    whether it was written before (experts.GradientBuffers.take)."""
    if layout.kernel == "native":
        return cpu_kernels.rows_outer(a_MI, b_MO, layout.offsets_L1, *(out or ()), b_index_M=b_index_M)
    if b_index_M is not None:
        b_MO = b_MO.index_select(0, b_index_M)
    if a_MI.shape[0] == 0:
        return a_MI.new_zeros(layout.num_groups, a_MI.shape[1], b_MO.shape[1])
    if layout.kernel in ("grouped", "triton"):
        product = _grouped_outer if layout.kernel == "grouped" else _triton_outer
        if layout.chunks is None:
            return product(a_MI, b_MO, layout.offsets, layout.counts_L)
        return torch.cat([product(a_MI[r0:r1], b_MO[r0:r1], offsets, layout.counts_L[e0:e1])
                          for e0, e1, r0, r1, offsets in layout.chunks])
    out_LIO = a_MI.new_empty(layout.num_groups, a_MI.shape[1], b_MO.shape[1])
    start = 0
    for e, count in enumerate(layout.host_counts):
        if count:
            torch.mm(a_MI[start:start + count].t(), b_MO[start:start + count], out=out_LIO[e])
            start += count
        else:
            out_LIO[e].zero_()
    return out_LIO


def pair_coefficients(gate_M: torch.Tensor | None, scale: float, like_MD: torch.Tensor) -> torch.Tensor:
    """Each pair's output factor, gate_m * scale (the scale alone without gates), in like's dtype: [M]. The forward
    scales the pairs' outputs by it and the backward their gradients: computed once, kept between them."""
    if gate_M is None:
        return like_MD.new_full((like_MD.shape[0],), scale)
    coef_M = gate_M.to(like_MD.dtype)
    if scale == 1.0:
        return coef_M
    return coef_M * scale if coef_M is gate_M else coef_M.mul_(scale)


def gate_gradient(dot_M: torch.Tensor, scale: float, gate_dtype: torch.dtype) -> torch.Tensor:
    """dL/dg_m = scale * dot_m (dot_m = <G_m, the pair's unscaled output>, in place) in the gates' dtype."""
    return (dot_M if scale == 1.0 else dot_M.mul_(scale)).to(gate_dtype)


def gated_rows(y_MD: torch.Tensor, coef_M: torch.Tensor, row_of_pair_M: torch.Tensor | None,
               num_rows: int) -> torch.Tensor:
    """An expert FFN's last step: each pair's output times its coefficient (pair_coefficients; in place), then,
    with `row_of_pair_M`, summed per row [num_rows, D]; without, per pair [M, D]."""
    y_MD.mul_(coef_M[:, None])
    if row_of_pair_M is None:
        return y_MD
    return y_MD.new_zeros(num_rows, y_MD.shape[1]).index_add_(0, row_of_pair_M, y_MD)


def row_dot(a_MI: torch.Tensor, b_MI: torch.Tensor) -> torch.Tensor:
    """sum(a * b, dim=1). On CPU in row chunks (no [M, I] temporary); on a GPU one batched product."""
    if not a_MI.shape[0]:
        return a_MI.new_zeros(0)
    rows = policy_for(a_MI).gate_chunk_rows
    if rows is None:
        return torch.bmm(a_MI[:, None, :], b_MI[:, :, None]).view(-1)
    return torch.cat([(a * b).sum(1) for a, b in zip(a_MI.split(rows), b_MI.split(rows))])


def _grouped_rows(a_MI: torch.Tensor, b_LIO: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm(a_MI, b_LIO, offs=offsets)


def _triton_rows(a_MI: torch.Tensor, b_LIO: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return triton_group_gemm(a_MI.contiguous(), b_LIO, offsets)


def _grouped_outer(a_MI, b_MO, offsets, counts_L) -> torch.Tensor:
    out_LIO = _grouped_mm(a_MI.t(), b_MO, offs=offsets)
    if out_LIO.is_cuda and torch.cuda.get_device_capability(out_LIO.device)[0] == 10:
        # Blackwell's kernel leaves experts without rows unwritten (pytorch/pytorch#172439); Hopper zeroes them.
        out_LIO.masked_fill_((counts_L == 0)[:, None, None], 0.0)
    return out_LIO


def _triton_outer(a_MI, b_MO, offsets, counts_L) -> torch.Tensor:
    return triton_grouped_dw(a_MI.contiguous(), b_MO.contiguous(), offsets)


_register_flop_formula()   # so FlopCounterMode counts the experts' products
