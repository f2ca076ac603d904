"""Native CPU kernels, built on first use: the experts' per-expert products (cpu_kernels.c),
the noisy gate's [tokens, experts] arithmetic (cpu_gating.c) and its normal noise (cpu_noise.c).

Legend: M rows sorted by expert, W [E, N, K] stacked expert matrices, `offsets_E1` [E + 1] int64 row
offsets (expert e owns rows offsets[e]:offsets[e + 1]); for the gate N tokens, E experts, K top-k and
M = min(K + 1, E) values kept per token.

The library is compiled with the C compiler ($CC, else cc) into $MOE_SCALE_CACHE/kernels (default
~/.cache/moe_scale/kernels), once per source text, flags and CPU model (it is built for this CPU, -march=native),
as DeepSpeed builds its own CPU ops on first use. Without a compiler, or with MOE_SCALE_NATIVE_KERNELS=0,
`available()` is False and the experts and the gate run on torch's ops; a failed build or load says why in
one warning. Each kernel is a torch.library custom op (torch.ops.moe_scale.*), so torch.compile can trace it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from moe_scale.data.embedded import cache_root
from moe_scale.moe.kernel_policy import policy_for

_SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_kernels.c", "cpu_gating.c", "cpu_noise.c"))
# -fno-math-errno: math calls without errno side effects, so loops calling them vectorise; glibc's vector
# math library on x86-64 Linux (see cpu_gating.c).
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
_LIBS = ("-lmvec", "-lm") if platform.system() == "Linux" and platform.machine() == "x86_64" \
    and platform.libc_ver()[0] == "glibc" else ("-lm",)
_GATE_ROWS_PER_BLOCK = 64   # the gate's load is summed per block of rows, then over blocks in order
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = {
    "rows_times_wt": [_P] * 5 + [_I] * 3 + [ctypes.c_int] + [_P] * 3 + [ctypes.c_int],
    "rows_times_w": [_P] * 4 + [_I] * 3 + [ctypes.c_int],
    "rows_outer": [_P] * 5 + [_I] * 3 + [ctypes.c_int] * 2,
    "noisy_top_k_forward": [_P] * 8 + [_I] * 5 + [_F, ctypes.c_int, ctypes.c_int],
    "noisy_top_k_backward": [_P] * 9 + [_I] * 4 + [_F, ctypes.c_int],
    "standard_normal": [_P, _I, ctypes.c_uint64, ctypes.c_int],
    "philox4x32_10_block": [_P] * 3,
}


def _cpu_signature() -> str:
    """What -march=native depends on: a library cached in a shared home must not run on another CPU model."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = {line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))}
    except OSError:
        lines = set()
    return platform.machine() + platform.processor() + "".join(sorted(lines))


def _build(compiler: str, target: Path) -> str | None:
    """Compiles into `target` (atomically: ranks building at once each install a whole library); returns
    why it failed, or None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", partial, *_LIBS],
                                capture_output=True, text=True)
        if result.returncode:
            first_error = next((line for line in result.stderr.splitlines() if "error" in line),
                               result.stderr.strip()[:200])
            return f"{compiler} failed: {first_error}"
        os.replace(partial, target)
        return None
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("MOE_SCALE_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC", "cc")
    why = None
    if shutil.which(compiler) is None:
        why = f"no C compiler {compiler!r} on PATH (set CC)"
    else:
        what = b"".join(source.read_bytes() for source in _SOURCES) + repr((compiler, _FLAGS, _LIBS)).encode()
        key = hashlib.sha256(what + _cpu_signature().encode()).hexdigest()[:16]
        cache = cache_root() / "kernels"
        path = cache / f"cpu_kernels-{key}.so"
        try:
            why = None if path.exists() else _build(compiler, path)
        except OSError as err:
            why = f"cannot write {cache}: {err.strerror} (set MOE_SCALE_CACHE)"
    library = None
    if not why:
        try:
            library = ctypes.CDLL(str(path))
        except OSError as err:
            why = f"cannot load {path}: {err} (delete it to rebuild)"
    if why:
        warnings.warn(f"moe_scale: native CPU kernels not built ({why}); the experts and the noisy gate run on "
                      "torch's ops", stacklevel=2)
        return None
    return _declare(library)


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """Gives the library's functions their C signatures."""
    for name, argtypes in _ARGTYPES.items():
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = None
    return library


@torch.compiler.assume_constant_result
def _built() -> bool:
    """Whether the library is built and loaded (torch.compile takes the answer as a constant)."""
    return _library() is not None


def available(like: torch.Tensor) -> bool:
    """The kernels take CPU float32 tensors, and need the library built (and not turned off by
    kernel_policy.gpu_decisions(), which traces what a GPU would run)."""
    return like.device.type == "cpu" and like.dtype == torch.float32 and policy_for(like).native_cpu and _built()


def _index(index_M: torch.Tensor | None, num_rows: int, num_sources: int) -> torch.Tensor | None:
    """A row index as the kernels read it: contiguous int64, one entry per row, each naming a source row."""
    if index_M is None:
        return None
    if index_M.shape != (num_rows,):
        raise ValueError(f"row index must have {num_rows} entries, got shape {list(index_M.shape)}")
    if num_rows:   # the kernels read through it unchecked
        low, high = torch.aminmax(index_M)
        if low < 0 or high >= num_sources:
            raise ValueError(f"row index must lie in [0, {num_sources}), got [{int(low)}, {int(high)}]")
    return index_M.to(torch.int64).contiguous()


def _rows(offsets_E1: torch.Tensor, expected: int) -> int:
    num_rows = int(offsets_E1[-1])
    if num_rows != expected:
        raise ValueError(f"offsets end at row {num_rows}, but the rows given are {expected}")
    return num_rows


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# The kernels are torch.library custom ops (namespace moe_scale), each with a fake implementation that gives
# its output shapes, so torch.compile traces through them (and opcheck can test them) instead of breaking its
# graph at a ctypes call. Their autograd stays in the autograd.Functions that call them (experts/ffn.py,
# router/gating_ops.py), which compute the forward and backward from these ops.

_ROWS_TIMES_WT = "(Tensor a_RK, Tensor w_ENK, Tensor offsets_E1, Tensor? index_M, bool relu) -> Tensor"
_ROWS_TIMES_WT_GRAD = ("(Tensor a_RK, Tensor w_ENK, Tensor offsets_E1, Tensor? index_M, Tensor hidden_MN, "
                       "Tensor scale_M) -> (Tensor, Tensor)")


def _rows_times_wt(a_RK, w_ENK, offsets_E1, index_M, relu, hidden_MN=None, scale_M=None):
    a_RK, w_ENK = a_RK.contiguous(), w_ENK.contiguous()
    num_rows = _rows(offsets_E1, a_RK.shape[0] if index_M is None else index_M.shape[0])
    index = _index(index_M, num_rows, a_RK.shape[0])
    out_MN = a_RK.new_empty(num_rows, w_ENK.shape[1])
    dot_M = None
    if hidden_MN is not None:
        hidden_MN, scale_M = hidden_MN.contiguous(), scale_M.to(torch.float32).contiguous()
        if hidden_MN.shape != out_MN.shape or hidden_MN.dtype != torch.float32 or scale_M.shape != (num_rows,):
            raise ValueError(f"relu_grad must be a float32 {list(out_MN.shape)} hidden layer and [{num_rows}] "
                             f"scales, got {hidden_MN.dtype} {list(hidden_MN.shape)} and {list(scale_M.shape)}")
        dot_M = a_RK.new_empty(num_rows)
    _library().rows_times_wt(a_RK.data_ptr(), _pointer(index), w_ENK.data_ptr(), out_MN.data_ptr(),
                             offsets_E1.data_ptr(), offsets_E1.shape[0] - 1, w_ENK.shape[1], w_ENK.shape[2],
                             int(relu), _pointer(hidden_MN), _pointer(scale_M), _pointer(dot_M),
                             torch.get_num_threads())
    return out_MN if hidden_MN is None else (out_MN, dot_M)


def _rows_of(a_RK, index_M):
    return a_RK.shape[0] if index_M is None else index_M.shape[0]


@torch.library.custom_op("moe_scale::rows_times_wt", mutates_args=(), device_types="cpu", schema=_ROWS_TIMES_WT)
def _rows_times_wt_op(a_RK, w_ENK, offsets_E1, index_M, relu):
    return _rows_times_wt(a_RK, w_ENK, offsets_E1, index_M, relu)


@_rows_times_wt_op.register_fake
def _(a_RK, w_ENK, offsets_E1, index_M, relu):
    return a_RK.new_empty(_rows_of(a_RK, index_M), w_ENK.shape[1])


@torch.library.custom_op("moe_scale::rows_times_wt_relu_grad", mutates_args=(), device_types="cpu",
                         schema=_ROWS_TIMES_WT_GRAD)
def _rows_times_wt_relu_grad_op(a_RK, w_ENK, offsets_E1, index_M, hidden_MN, scale_M):
    return _rows_times_wt(a_RK, w_ENK, offsets_E1, index_M, False, hidden_MN, scale_M)


@_rows_times_wt_relu_grad_op.register_fake
def _(a_RK, w_ENK, offsets_E1, index_M, hidden_MN, scale_M):
    rows = _rows_of(a_RK, index_M)
    return a_RK.new_empty(rows, w_ENK.shape[1]), a_RK.new_empty(rows)


def rows_times_wt(a_RK: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor,
                  a_index_M: torch.Tensor | None = None, relu: bool = False,
                  relu_grad: tuple[torch.Tensor, torch.Tensor] | None = None):
    """out[rows of e] = a[rows of e] @ w[e].T: [M, N], where row r reads a[a_index_M[r]] if an index is given
    (else a[r], M = R); `relu` clamps the result at 0.

    relu_grad = (hidden_MN, scale_M): the ReLU's backward as well, on each row while it is in cache; returns
    (g, dot_M) with dot_M[r] = <out[r], hidden[r]> and g[r] = out[r] * scale[r] where hidden[r] > 0, else 0."""
    if relu_grad is None:
        return torch.ops.moe_scale.rows_times_wt(a_RK, w_ENK, offsets_E1, a_index_M, relu)
    return torch.ops.moe_scale.rows_times_wt_relu_grad(a_RK, w_ENK, offsets_E1, a_index_M, *relu_grad)


@torch.library.custom_op("moe_scale::rows_times_w", mutates_args=(), device_types="cpu",
                         schema="(Tensor a_MN, Tensor w_ENK, Tensor offsets_E1) -> Tensor")
def _rows_times_w_op(a_MN, w_ENK, offsets_E1):
    a_MN, w_ENK = a_MN.contiguous(), w_ENK.contiguous()
    _rows(offsets_E1, a_MN.shape[0])
    out_MK = a_MN.new_empty(a_MN.shape[0], w_ENK.shape[2])
    _library().rows_times_w(a_MN.data_ptr(), w_ENK.data_ptr(), out_MK.data_ptr(), offsets_E1.data_ptr(),
                            offsets_E1.shape[0] - 1, w_ENK.shape[1], w_ENK.shape[2], torch.get_num_threads())
    return out_MK


@_rows_times_w_op.register_fake
def _(a_MN, w_ENK, offsets_E1):
    return a_MN.new_empty(a_MN.shape[0], w_ENK.shape[2])


def rows_times_w(a_MN: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ w[e]: [M, K]."""
    return torch.ops.moe_scale.rows_times_w(a_MN, w_ENK, offsets_E1)


@torch.library.custom_op("moe_scale::rows_outer_", mutates_args=("out_ENK",), device_types="cpu",
                         schema="(Tensor a_MN, Tensor b_RK, Tensor offsets_E1, Tensor(a!) out_ENK, bool out_mapped, "
                                "Tensor? index_M) -> ()")
def _rows_outer_op(a_MN, b_RK, offsets_E1, out_ENK, out_mapped, index_M):
    a_MN, b_RK = a_MN.contiguous(), b_RK.contiguous()
    _rows(offsets_E1, a_MN.shape[0])
    index = _index(index_M, a_MN.shape[0], b_RK.shape[0])
    shape = (offsets_E1.shape[0] - 1, a_MN.shape[1], b_RK.shape[1])
    if out_ENK.shape != shape or not out_ENK.is_contiguous() or out_ENK.dtype != torch.float32:
        raise ValueError(f"out must be a contiguous float32 {list(shape)} tensor, got {out_ENK.dtype} "
                         f"{list(out_ENK.shape)}")
    _library().rows_outer(a_MN.data_ptr(), b_RK.data_ptr(), _pointer(index), out_ENK.data_ptr(),
                          offsets_E1.data_ptr(), shape[0], shape[1], shape[2], torch.get_num_threads(),
                          int(out_mapped))


@_rows_outer_op.register_fake
def _(a_MN, b_RK, offsets_E1, out_ENK, out_mapped, index_M):
    return None


def rows_outer(a_MN: torch.Tensor, b_RK: torch.Tensor, offsets_E1: torch.Tensor,
               out_ENK: torch.Tensor | None = None, out_mapped: bool = False,
               b_index_M: torch.Tensor | None = None) -> torch.Tensor:
    """out[e] = a[rows of e].T @ b[rows of e]: [E, N, K], exact zeros for an expert with no rows, where row r
    of b is b[b_index_M[r]] if an index is given; written over `out_ENK` (contiguous float32 [E, N, K]) when
    given. `out_mapped`: its memory has been written before (it then takes streaming stores, which are
    slower into fresh pages)."""
    if out_ENK is None:
        out_ENK = a_MN.new_empty(offsets_E1.shape[0] - 1, a_MN.shape[1], b_RK.shape[1])
    torch.ops.moe_scale.rows_outer_(a_MN, b_RK, offsets_E1, out_ENK, out_mapped, b_index_M)
    return out_ENK


@torch.library.custom_op("moe_scale::noisy_top_k_forward", mutates_args=(), device_types="cpu",
                         schema="(Tensor clean_NE, Tensor z_NE, Tensor noise_NE, float eps, int k, bool smooth_load) "
                                "-> (Tensor, Tensor, Tensor, Tensor)")
def _noisy_top_k_forward_op(clean_NE, z_NE, noise_NE, eps, k, smooth_load):
    clean_NE, z_NE, noise_NE = clean_NE.contiguous(), z_NE.contiguous(), noise_NE.contiguous()
    (n, e), m = clean_NE.shape, min(k + 1, clean_NE.shape[1])
    std_NE = torch.empty_like(clean_NE)
    top_values_NM, top_idx_NM = clean_NE.new_empty(n, m), torch.empty(n, m, dtype=torch.int64)
    load_E = clean_NE.new_zeros(e)
    load_blocks = clean_NE.new_empty(-(-n // _GATE_ROWS_PER_BLOCK) if smooth_load else 0, e)
    _library().noisy_top_k_forward(clean_NE.data_ptr(), z_NE.data_ptr(), noise_NE.data_ptr(), std_NE.data_ptr(),
                                   top_values_NM.data_ptr(), top_idx_NM.data_ptr(), load_E.data_ptr(),
                                   load_blocks.data_ptr(), n, e, k, m, _GATE_ROWS_PER_BLOCK, eps, int(smooth_load),
                                   torch.get_num_threads())
    return std_NE, top_values_NM, top_idx_NM, load_E


@_noisy_top_k_forward_op.register_fake
def _(clean_NE, z_NE, noise_NE, eps, k, smooth_load):
    (n, e), m = clean_NE.shape, min(k + 1, clean_NE.shape[1])
    return (torch.empty_like(clean_NE), clean_NE.new_empty(n, m), clean_NE.new_empty(n, m, dtype=torch.int64),
            clean_NE.new_empty(e))


def noisy_top_k_forward(clean_NE: torch.Tensor, z_NE: torch.Tensor, noise_NE: torch.Tensor, eps: float, k: int,
                        smooth_load: bool) -> tuple[torch.Tensor, ...]:
    """(std_NE, top_values_NM, top_idx_NM, load_E): gating_ops.noisy_top_k's forward (load zeros unless
    `smooth_load`), and the std it keeps for the backward."""
    return torch.ops.moe_scale.noisy_top_k_forward(clean_NE, z_NE, noise_NE, eps, k, smooth_load)


@torch.library.custom_op("moe_scale::noisy_top_k_backward", mutates_args=(), device_types="cpu",
                         schema="(Tensor clean_NE, Tensor noise_NE, Tensor std_NE, Tensor top_values_NM, "
                                "Tensor top_idx_NM, Tensor grad_top_NM, Tensor? grad_load_E, float eps, int k) "
                                "-> (Tensor, Tensor)")
def _noisy_top_k_backward_op(clean_NE, noise_NE, std_NE, top_values_NM, top_idx_NM, grad_top_NM, grad_load_E,
                             eps, k):
    grad_top_NM = grad_top_NM.clone(memory_format=torch.contiguous_format)   # the thresholds' share is added
    grad_load_E = None if grad_load_E is None else grad_load_E.contiguous()
    grad_clean_NE, grad_z_NE = torch.empty_like(clean_NE), torch.empty_like(clean_NE)
    (n, e), m = clean_NE.shape, top_values_NM.shape[1]
    _library().noisy_top_k_backward(clean_NE.data_ptr(), noise_NE.data_ptr(), std_NE.data_ptr(),
                                    top_values_NM.data_ptr(), top_idx_NM.data_ptr(), grad_top_NM.data_ptr(),
                                    None if grad_load_E is None else grad_load_E.data_ptr(),
                                    grad_clean_NE.data_ptr(), grad_z_NE.data_ptr(), n, e, k, m, eps,
                                    torch.get_num_threads())
    return grad_clean_NE, grad_z_NE


@_noisy_top_k_backward_op.register_fake
def _(clean_NE, noise_NE, std_NE, top_values_NM, top_idx_NM, grad_top_NM, grad_load_E, eps, k):
    return torch.empty_like(clean_NE), torch.empty_like(clean_NE)


def noisy_top_k_backward(clean_NE, noise_NE, std_NE, top_values_NM, top_idx_NM, grad_top_NM: torch.Tensor,
                         grad_load_E: torch.Tensor | None, eps: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_clean_NE, grad_z_NE) from the gradients of the top values and (if not None) of the load."""
    return torch.ops.moe_scale.noisy_top_k_backward(clean_NE, noise_NE, std_NE, top_values_NM, top_idx_NM,
                                                    grad_top_NM, grad_load_E, eps, k)


@torch.library.custom_op("moe_scale::standard_normal", mutates_args=(), device_types="cpu",
                         schema="(Tensor seed, SymInt[] shape) -> Tensor")
def _standard_normal_op(seed, shape):
    out = torch.empty(shape)
    _library().standard_normal(out.data_ptr(), out.numel(), int(seed), torch.get_num_threads())
    return out


@_standard_normal_op.register_fake
def _(seed, shape):
    return seed.new_empty(shape, dtype=torch.float32)


def standard_normal(*shape: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard normal float32 noise of `shape` from cpu_noise.c (Philox4x32-10 + Box-Muller). Its seed is one
    draw from torch's generator (the global one by default), so torch.manual_seed makes it reproducible."""
    seed = torch.randint(0, 2**63 - 1, (), generator=generator)
    return torch.ops.moe_scale.standard_normal(seed, list(shape))
