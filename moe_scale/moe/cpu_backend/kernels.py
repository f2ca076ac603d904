"""Native CPU kernels, built on first use: the experts' per-expert products (cpu_kernels.c),
the noisy gate's [tokens, experts] arithmetic (cpu_gating.c) and its normal noise (cpu_noise.c).

Legend (docs/shapes.md): M rows sorted by local expert, R rows read through an index, L local experts,
O a stacked expert matrix's rows, I its columns (w [L, O, I]), N tokens, E experts, K experts per token,
K1 = min(K + 1, E) logits the gate keeps per token.

`offsets_L1` [L + 1] int64 row offsets: expert e owns rows offsets[e]:offsets[e + 1].

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


def _rows(offsets_L1: torch.Tensor, expected: int) -> int:
    num_rows = int(offsets_L1[-1])
    if num_rows != expected:
        raise ValueError(f"offsets end at row {num_rows}, but the rows given are {expected}")
    return num_rows


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# The kernels are torch.library custom ops (namespace moe_scale), each with a fake implementation that gives
# its output shapes, so torch.compile traces through them (and opcheck can test them) instead of breaking its
# graph at a ctypes call. Their autograd stays in the autograd.Functions that call them (experts/ffn.py,
# router/gating_ops.py), which compute the forward and backward from these ops.

_ROWS_TIMES_WT = "(Tensor a_RI, Tensor w_LOI, Tensor offsets_L1, Tensor? index_M, bool relu) -> Tensor"
_ROWS_TIMES_WT_GRAD = ("(Tensor a_RI, Tensor w_LOI, Tensor offsets_L1, Tensor? index_M, Tensor hidden_MO, "
                       "Tensor scale_M) -> (Tensor, Tensor)")


def _rows_times_wt(a_RI, w_LOI, offsets_L1, index_M, relu, hidden_MO=None, scale_M=None):
    a_RI, w_LOI = a_RI.contiguous(), w_LOI.contiguous()
    num_rows = _rows(offsets_L1, a_RI.shape[0] if index_M is None else index_M.shape[0])
    index = _index(index_M, num_rows, a_RI.shape[0])
    out_MO = a_RI.new_empty(num_rows, w_LOI.shape[1])
    dot_M = None
    if hidden_MO is not None:
        hidden_MO, scale_M = hidden_MO.contiguous(), scale_M.to(torch.float32).contiguous()
        if hidden_MO.shape != out_MO.shape or hidden_MO.dtype != torch.float32 or scale_M.shape != (num_rows,):
            raise ValueError(f"relu_grad must be a float32 {list(out_MO.shape)} hidden layer and [{num_rows}] "
                             f"scales, got {hidden_MO.dtype} {list(hidden_MO.shape)} and {list(scale_M.shape)}")
        dot_M = a_RI.new_empty(num_rows)
    _library().rows_times_wt(a_RI.data_ptr(), _pointer(index), w_LOI.data_ptr(), out_MO.data_ptr(),
                             offsets_L1.data_ptr(), offsets_L1.shape[0] - 1, w_LOI.shape[1], w_LOI.shape[2],
                             int(relu), _pointer(hidden_MO), _pointer(scale_M), _pointer(dot_M),
                             torch.get_num_threads())
    return out_MO if hidden_MO is None else (out_MO, dot_M)


def _rows_of(a_RI, index_M):
    return a_RI.shape[0] if index_M is None else index_M.shape[0]


@torch.library.custom_op("moe_scale::rows_times_wt", mutates_args=(), device_types="cpu", schema=_ROWS_TIMES_WT)
def _rows_times_wt_op(a_RI, w_LOI, offsets_L1, index_M, relu):
    return _rows_times_wt(a_RI, w_LOI, offsets_L1, index_M, relu)


@_rows_times_wt_op.register_fake
def _(a_RI, w_LOI, offsets_L1, index_M, relu):
    return a_RI.new_empty(_rows_of(a_RI, index_M), w_LOI.shape[1])


@torch.library.custom_op("moe_scale::rows_times_wt_relu_grad", mutates_args=(), device_types="cpu",
                         schema=_ROWS_TIMES_WT_GRAD)
def _rows_times_wt_relu_grad_op(a_RI, w_LOI, offsets_L1, index_M, hidden_MO, scale_M):
    return _rows_times_wt(a_RI, w_LOI, offsets_L1, index_M, False, hidden_MO, scale_M)


@_rows_times_wt_relu_grad_op.register_fake
def _(a_RI, w_LOI, offsets_L1, index_M, hidden_MO, scale_M):
    rows = _rows_of(a_RI, index_M)
    return a_RI.new_empty(rows, w_LOI.shape[1]), a_RI.new_empty(rows)


def rows_times_wt(a_RI: torch.Tensor, w_LOI: torch.Tensor, offsets_L1: torch.Tensor,
                  a_index_M: torch.Tensor | None = None, relu: bool = False,
                  relu_grad: tuple[torch.Tensor, torch.Tensor] | None = None):
    """out[rows of e] = a[rows of e] @ w[e].T: [M, N], where row r reads a[a_index_M[r]] if an index is given
    (else a[r], M = R); `relu` clamps the result at 0.

    relu_grad = (hidden_MO, scale_M): the ReLU's backward as well, on each row while it is in cache; returns
    (g, dot_M) with dot_M[r] = <out[r], hidden[r]> and g[r] = out[r] * scale[r] where hidden[r] > 0, else 0."""
    if relu_grad is None:
        return torch.ops.moe_scale.rows_times_wt(a_RI, w_LOI, offsets_L1, a_index_M, relu)
    return torch.ops.moe_scale.rows_times_wt_relu_grad(a_RI, w_LOI, offsets_L1, a_index_M, *relu_grad)


@torch.library.custom_op("moe_scale::rows_times_w", mutates_args=(), device_types="cpu",
                         schema="(Tensor a_MO, Tensor w_LOI, Tensor offsets_L1) -> Tensor")
def _rows_times_w_op(a_MO, w_LOI, offsets_L1):
    a_MO, w_LOI = a_MO.contiguous(), w_LOI.contiguous()
    _rows(offsets_L1, a_MO.shape[0])
    out_MI = a_MO.new_empty(a_MO.shape[0], w_LOI.shape[2])
    _library().rows_times_w(a_MO.data_ptr(), w_LOI.data_ptr(), out_MI.data_ptr(), offsets_L1.data_ptr(),
                            offsets_L1.shape[0] - 1, w_LOI.shape[1], w_LOI.shape[2], torch.get_num_threads())
    return out_MI


@_rows_times_w_op.register_fake
def _(a_MO, w_LOI, offsets_L1):
    return a_MO.new_empty(a_MO.shape[0], w_LOI.shape[2])


def rows_times_w(a_MO: torch.Tensor, w_LOI: torch.Tensor, offsets_L1: torch.Tensor) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ w[e]: [M, K]."""
    return torch.ops.moe_scale.rows_times_w(a_MO, w_LOI, offsets_L1)


@torch.library.custom_op("moe_scale::rows_outer_", mutates_args=("out_LOI",), device_types="cpu",
                         schema="(Tensor a_MO, Tensor b_RI, Tensor offsets_L1, Tensor(a!) out_LOI, bool out_mapped, "
                                "Tensor? index_M) -> ()")
def _rows_outer_op(a_MO, b_RI, offsets_L1, out_LOI, out_mapped, index_M):
    a_MO, b_RI = a_MO.contiguous(), b_RI.contiguous()
    _rows(offsets_L1, a_MO.shape[0])
    index = _index(index_M, a_MO.shape[0], b_RI.shape[0])
    shape = (offsets_L1.shape[0] - 1, a_MO.shape[1], b_RI.shape[1])
    if out_LOI.shape != shape or not out_LOI.is_contiguous() or out_LOI.dtype != torch.float32:
        raise ValueError(f"out must be a contiguous float32 {list(shape)} tensor, got {out_LOI.dtype} "
                         f"{list(out_LOI.shape)}")
    _library().rows_outer(a_MO.data_ptr(), b_RI.data_ptr(), _pointer(index), out_LOI.data_ptr(),
                          offsets_L1.data_ptr(), shape[0], shape[1], shape[2], torch.get_num_threads(),
                          int(out_mapped))


@_rows_outer_op.register_fake
def _(a_MO, b_RI, offsets_L1, out_LOI, out_mapped, index_M):
    return None


def rows_outer(a_MO: torch.Tensor, b_RI: torch.Tensor, offsets_L1: torch.Tensor,
               out_LOI: torch.Tensor | None = None, out_mapped: bool = False,
               b_index_M: torch.Tensor | None = None) -> torch.Tensor:
    """out[e] = a[rows of e].T @ b[rows of e]: [L, O, I], exact zeros for an expert with no rows, where row r
    of b is b[b_index_M[r]] if an index is given; written over `out_LOI` (contiguous float32 [L, O, I]) when
    given. `out_mapped`: its memory has been written before (it then takes streaming stores, which are
    slower into fresh pages)."""
    if out_LOI is None:
        out_LOI = a_MO.new_empty(offsets_L1.shape[0] - 1, a_MO.shape[1], b_RI.shape[1])
    torch.ops.moe_scale.rows_outer_(a_MO, b_RI, offsets_L1, out_LOI, out_mapped, b_index_M)
    return out_LOI


@torch.library.custom_op("moe_scale::noisy_top_k_forward", mutates_args=(), device_types="cpu",
                         schema="(Tensor clean_NE, Tensor z_NE, Tensor noise_NE, float eps, int k, bool smooth_load) "
                                "-> (Tensor, Tensor, Tensor, Tensor)")
def _noisy_top_k_forward_op(clean_NE, z_NE, noise_NE, eps, k, smooth_load):
    clean_NE, z_NE, noise_NE = clean_NE.contiguous(), z_NE.contiguous(), noise_NE.contiguous()
    (n, e), m = clean_NE.shape, min(k + 1, clean_NE.shape[1])
    softplus_NE = torch.empty_like(clean_NE)
    top_values_NK1, top_idx_NK1 = clean_NE.new_empty(n, m), torch.empty(n, m, dtype=torch.int64)
    load_E = clean_NE.new_zeros(e)
    load_blocks = clean_NE.new_empty(-(-n // _GATE_ROWS_PER_BLOCK) if smooth_load else 0, e)
    _library().noisy_top_k_forward(clean_NE.data_ptr(), z_NE.data_ptr(), noise_NE.data_ptr(), softplus_NE.data_ptr(),
                                   top_values_NK1.data_ptr(), top_idx_NK1.data_ptr(), load_E.data_ptr(),
                                   load_blocks.data_ptr(), n, e, k, m, _GATE_ROWS_PER_BLOCK, eps, int(smooth_load),
                                   torch.get_num_threads())
    return softplus_NE, top_values_NK1, top_idx_NK1, load_E


@_noisy_top_k_forward_op.register_fake
def _(clean_NE, z_NE, noise_NE, eps, k, smooth_load):
    (n, e), m = clean_NE.shape, min(k + 1, clean_NE.shape[1])
    return (torch.empty_like(clean_NE), clean_NE.new_empty(n, m), clean_NE.new_empty(n, m, dtype=torch.int64),
            clean_NE.new_empty(e))


def noisy_top_k_forward(clean_NE: torch.Tensor, z_NE: torch.Tensor, noise_NE: torch.Tensor, eps: float, k: int,
                        smooth_load: bool) -> tuple[torch.Tensor, ...]:
    """(softplus_NE, top_values_NK1, top_idx_NK1, load_E): gating_ops.noisy_top_k's forward (load zeros unless
    `smooth_load`), and softplus(z) (the std less eps), which it keeps for the backward."""
    return torch.ops.moe_scale.noisy_top_k_forward(clean_NE, z_NE, noise_NE, eps, k, smooth_load)


@torch.library.custom_op("moe_scale::noisy_top_k_backward", mutates_args=(), device_types="cpu",
                         schema="(Tensor clean_NE, Tensor noise_NE, Tensor softplus_NE, Tensor top_values_NK1, "
                                "Tensor top_idx_NK1, Tensor grad_top_NK1, Tensor? grad_load_E, float eps, int k) "
                                "-> (Tensor, Tensor)")
def _noisy_top_k_backward_op(clean_NE, noise_NE, softplus_NE, top_values_NK1, top_idx_NK1, grad_top_NK1, grad_load_E,
                             eps, k):
    grad_top_NK1 = grad_top_NK1.clone(memory_format=torch.contiguous_format)   # the thresholds' share is added
    grad_load_E = None if grad_load_E is None else grad_load_E.contiguous()
    grad_clean_NE, grad_z_NE = torch.empty_like(clean_NE), torch.empty_like(clean_NE)
    (n, e), m = clean_NE.shape, top_values_NK1.shape[1]
    _library().noisy_top_k_backward(clean_NE.data_ptr(), noise_NE.data_ptr(), softplus_NE.data_ptr(),
                                    top_values_NK1.data_ptr(), top_idx_NK1.data_ptr(), grad_top_NK1.data_ptr(),
                                    None if grad_load_E is None else grad_load_E.data_ptr(),
                                    grad_clean_NE.data_ptr(), grad_z_NE.data_ptr(), n, e, k, m, eps,
                                    torch.get_num_threads())
    return grad_clean_NE, grad_z_NE


@_noisy_top_k_backward_op.register_fake
def _(clean_NE, noise_NE, softplus_NE, top_values_NK1, top_idx_NK1, grad_top_NK1, grad_load_E, eps, k):
    return torch.empty_like(clean_NE), torch.empty_like(clean_NE)


def noisy_top_k_backward(clean_NE, noise_NE, softplus_NE, top_values_NK1, top_idx_NK1, grad_top_NK1: torch.Tensor,
                         grad_load_E: torch.Tensor | None, eps: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_clean_NE, grad_z_NE) from the gradients of the top values and (if not None) of the load."""
    return torch.ops.moe_scale.noisy_top_k_backward(clean_NE, noise_NE, softplus_NE, top_values_NK1, top_idx_NK1,
                                                    grad_top_NK1, grad_load_E, eps, k)


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
