"""Count the operations a piece of code dispatches, and those that would block the host on a GPU.

Structure, not time: on a GPU every dispatched operation is (at least) one kernel launch, and every
operation below makes the host wait for the device (it needs a value, or a size, that only the device
knows). Counted here on any device, CPU included, so a test can fail when a per-expert loop or a hidden
synchronisation comes back.

Host-blocking on CUDA (the list tools/count_ops.py documents):

    _local_scalar_dense       .item(), int(t), float(t), bool(t), a tensor used as a Python index
    nonzero                   also what boolean-mask indexing and masked_select run
    masked_select, index/index_put with a bool mask
    _unique, _unique2, unique_dim, unique_consecutive, unique_dim_consecutive   (output size)
    bincount                  CUDA reads the input's min and max first, even with minlength
    repeat_interleave         with a tensor of repeats and no output_size
    histc                     with min == max (it reads the data's range)
    equal, is_nonzero         return a Python bool
    Tensor.tolist / .numpy / .cpu    (copies to the host; patched in while counting, since on a CPU tensor
                              they dispatch nothing)
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS_BLOCKING = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                    "unique_consecutive", "unique_dim_consecutive", "bincount", "equal", "is_nonzero"}
_HOST_COPIES = ("tolist", "numpy", "cpu")
_METADATA_ONLY = {"_unsafe_view", "promote_types", "sym_size", "sym_stride", "sym_numel",   # no kernel either
                  "_record_function_enter_new", "_record_function_exit",   # (profiler ranges)
                  # uninitialised allocations: the caching allocator, no kernel (unless deterministic algorithms
                  # fill new memory: torch.utils.deterministic.fill_uninitialized_memory, which moe_scale never sets)
                  "empty", "new_empty", "empty_like", "empty_strided"}


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def blocks_host(name: str, overload: str, args: tuple, kwargs: dict) -> bool:
    """Whether aten op `name`.`overload` called with these arguments waits for the device."""
    if name in _ALWAYS_BLOCKING:
        return True
    if name == "repeat_interleave":   # int repeats (self_int) never read the device
        return overload in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return _has_bool_index(args)
    if name == "histc":
        low = args[2] if len(args) > 2 else kwargs.get("min", 0)
        high = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return low == high
    return False


class OpCounter(TorchDispatchMode):
    """with OpCounter() as counter: ... ; counter.ops, counter.kernel_ops, counter.host_syncs, counter.by_name.

    `kernel_ops` leaves out views (view, slice, transpose, expand, detach, ...) and other metadata-only operations:
    what launches work on a device."""

    def __init__(self):
        super().__init__()
        self.ops, self.kernel_ops, self.by_name, self.syncs = 0, 0, Counter(), Counter()
        self._patched: dict[str, object] = {}
        self._paused = False

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.ops += 1
        self.kernel_ops += not (func.is_view or name in _METADATA_ONLY)
        self.by_name[name] += 1
        if blocks_host(name, func._overloadname, args, kwargs):
            self.host_sync(name)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def uncounted(self):
        """Operations run within this block are not counted (a fused kernel's stand-in counts itself instead:
        count_kernel)."""
        outer, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = outer

    def count_kernel(self, name: str) -> None:
        """One kernel launch of a device's own that this CPU runs as other operations (tools/cudnn_lstm.py)."""
        self.ops += 1
        self.kernel_ops += 1
        self.by_name[name] += 1

    def host_sync(self, name: str) -> None:
        """One operation that makes the host wait for the device (subclasses also note where it came from)."""
        self.syncs[name] += 1

    def __enter__(self):
        for method in _HOST_COPIES:
            original = getattr(torch.Tensor, method)
            self._patched[method] = original

            def counted(tensor, *args, _original=original, _method=method, **kwargs):
                self.host_sync(f"Tensor.{_method}")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._patched.items():
            setattr(torch.Tensor, method, original)
        self._patched = {}
        return super().__exit__(*exc)
