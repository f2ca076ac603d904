"""One regular training step counted as a GPU would run it: its host-blocking reads, each with the line that makes
it, and its kernel-launching operations, by phase (tools/count_step_syncs.py; the counts: docs/gpu.md).

The step runs on CPU through `moe-scale train` itself (moe_scale.cli.main: the loop's step, DeepSpeed's engine, its
ZeRO optimizer), with CUDA's decisions forced on:

    moe_scale   kernel_policy.gpu_decisions(): the GPU's kernels (no native CPU kernels, whole-tensor gates)
    torch       an LSTM counted as cuDNN's one kernel each way (tools/cudnn_lstm.py), not as this CPU's path
    DeepSpeed   its accelerator replaced by `SimulatedCuda`: CPU tensors on an asynchronous device with streams and
                events (is_synchronized_device() is False, as CUDA's), so ZeRO takes its CUDA paths (overlap_comm's
                reduction stream and the synchronisations that guard it)

Counted in step `counted_step` (not the first, which sets things up lazily; not a log, eval or checkpoint point):

    host reads     what makes the host wait for the device: OpCounter's operations (.item(), bool(t), .tolist(),
                   nonzero, ...); DeepSpeed's get_accelerator().synchronize(), a stream's or an event's
                   synchronize(), torch.cuda.synchronize(); a blocking copy of host data to the device
                   (torch.tensor / torch.as_tensor of Python numbers with a device: CUDA waits for the stream)
    all-to-all     of those, the one read of the counts an expert-parallel exchange needs (all_to_all_single takes
                   its split sizes as Python ints; the row-split vocabulary tables' exchanges and gathers too),
                   reported apart: the one read the team's rules allow
    device waits   a stream waiting for a stream or an event (the device waits, the host does not): reported, not
                   counted
    kernel_ops     operations that launch work on a device (OpCounter.kernel_ops)

by phase: forward (the engine's forward), backward (the engine's backward, gradient reduction included), clip (the
gradient norm and clipping, inside DeepSpeed's step under ZeRO), optimizer (the rest of DeepSpeed's step), loop
(everything else from the step's start to the end of its points: batch, sums, report, stop requests).

Reads of tensors that stay on the host in a GPU run (`HOST_SIDE`: e.g. the stop-request flag on its gloo group)
are listed apart and not counted: on CPU every tensor is a host tensor, so these are named, with the reason.
A branch moe_scale takes only on CUDA tensors (`device.type == "cuda"`) is not traced; each such branch in a step
is free of reads by construction: pinned copies with non_blocking (train/loop.py), CUDA events read at log points
only (moe/dispatch/exchange.py's CommTimer, train/step_stats.py's StepTimer). Nor is a host tensor's `.to(device)`
(on CPU no copy at all): none is made in a step (train/loop.py's batches are the pinned copies above).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

import torch

import moe_scale
from cudnn_lstm import one_kernel_lstm
from op_count import OpCounter

PHASES = ("forward", "backward", "clip", "optimizer", "loop")
TOP_OPS = 6   # the most frequent kernel-launching operations reported per phase
_REPO = Path(moe_scale.__file__).resolve().parents[1]   # whose files the report names
_TORCH = Path(torch.__file__).resolve().parent
# Frames skipped when looking for the line that makes a read: torch's own, and the counting machinery.
_SKIPPED = (str(_TORCH), str(Path(__file__).resolve()), str(Path(__file__).resolve().with_name("op_count.py")))

# Reads of tensors that live on the host in a GPU run too: (file, function) -> why.
HOST_SIDE = {
    ("moe_scale/train/preemption.py", "agreed"): "the stop-request flag: a CPU tensor on a gloo group on GPUs too",
}
# The exchanges' reads of their counts, where rows really travel (LocalExchange moves nothing): the expert layers'
# (read function, its caller), and the row-split vocabulary tables' (models/vocab_parallel.py).
_COUNT_READS = {("_read_to_host", "FlatExchange.plan"), ("_read_to_host", "HierarchicalExchange.plan"),
                ("_read_counts", "_FetchRows.forward"), ("_read_counts", "_row_counts")}


def _where(path: str) -> str:
    """A file as the report names it: relative to the repository, or to site-packages (deepspeed/...)."""
    file = Path(path).resolve()
    for root in (_REPO, *(Path(p) for p in sys.path if p.endswith("site-packages"))):
        try:
            return str(file.relative_to(root))
        except ValueError:
            continue
    return str(file)


def _caller() -> tuple[str, int, str, str]:
    """(file, line, function, the function that called it) of the first frame outside torch and this machinery."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
    if frame is None:
        return "?", 0, "?", "?"
    up = frame.f_back
    return (_where(frame.f_code.co_filename), frame.f_lineno, frame.f_code.co_qualname,
            up.f_code.co_qualname if up is not None else "?")


class StepCounter(OpCounter):
    """OpCounter by phase, each host read with its line; `phase` is set by the wrappers `_in_phase` puts around the
    functions of `_phase_targets`."""

    def __init__(self):
        super().__init__()
        self.phase = "loop"
        self.kernel_ops_by_phase: Counter = Counter()
        self.kernel_names: Counter = Counter()   # (phase, aten operation) -> kernel-launching calls
        self.reads: Counter = Counter()        # (phase, kind, file, line, function, caller) -> count
        self.device_waits: Counter = Counter()   # (phase, kind, file, line, function) -> count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.kernel_ops
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.kernel_ops > before:
            self.kernel_ops_by_phase[self.phase] += 1
            self.kernel_names[(self.phase, func.overloadpacket.__name__)] += 1
        return out

    def count_kernel(self, name: str) -> None:
        super().count_kernel(name)
        self.kernel_ops_by_phase[self.phase] += 1
        self.kernel_names[(self.phase, name)] += 1

    def host_sync(self, name: str) -> None:
        super().host_sync(name)
        self.reads[(self.phase, name, *_caller())] += 1

    def device_wait(self, name: str) -> None:
        self.device_waits[(self.phase, name, *_caller()[:3])] += 1

    def report(self) -> dict:
        """Per phase: kernel_ops, host_reads (all-to-all count reads apart); every read with its line."""
        phases = {p: {"kernel_ops": self.kernel_ops_by_phase[p], "host_reads": 0, "all_to_all_count_reads": 0,
                      "top_kernel_ops": dict(Counter({name: n for (phase, name), n in self.kernel_names.items()
                                                      if phase == p}).most_common(TOP_OPS))}
                  for p in PHASES}
        reads, host_side = [], []
        for (phase, kind, file, line, function, caller), count in sorted(self.reads.items()):
            entry = {"phase": phase, "kind": kind, "site": f"{file}:{line} {function}", "count": count}
            if (file, function.split(".")[-1]) in HOST_SIDE:
                host_side.append({**entry, "why": HOST_SIDE[(file, function.split(".")[-1])]})
                continue
            all_to_all = (function, caller) in _COUNT_READS
            phases[phase]["all_to_all_count_reads" if all_to_all else "host_reads"] += count
            reads.append({**entry, "all_to_all": all_to_all})
        waits = [{"phase": phase, "kind": kind, "site": f"{file}:{line} {function}", "count": count}
                 for (phase, kind, file, line, function), count in sorted(self.device_waits.items())]
        return {"host_reads": sum(p["host_reads"] for p in phases.values()),
                "all_to_all_count_reads": sum(p["all_to_all_count_reads"] for p in phases.values()),
                "kernel_ops": sum(p["kernel_ops"] for p in phases.values()),
                "phases": phases, "reads": reads, "host_side_reads": host_side, "device_waits": waits}


_active: list[StepCounter] = []   # the counter of the step being counted (none between)


def _note_read(kind: str) -> None:
    if _active:
        _active[-1].host_sync(kind)


def _note_wait(kind: str) -> None:
    if _active:
        _active[-1].device_wait(kind)


class _Event:
    """A CUDA event as DeepSpeed uses it: synchronize() makes the host wait; wait() makes a stream wait."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        pass

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _note_read("event.synchronize")

    def wait(self, stream=None) -> None:
        _note_wait("event.wait")

    def elapsed_time(self, end) -> float:
        return 0.0


class _Stream:
    """A CUDA stream as DeepSpeed uses it."""

    def __init__(self, device=None, priority: int = 0):
        pass

    def synchronize(self) -> None:
        _note_read("stream.synchronize")

    def wait_stream(self, stream) -> None:
        _note_wait("stream.wait_stream")

    def wait_event(self, event) -> None:
        _note_wait("stream.wait_event")

    def record_event(self, event=None):
        return event or _Event()

    def query(self) -> bool:
        return True


def simulated_cuda():
    """DeepSpeed's CPU accelerator with CUDA's answers: an asynchronous device with streams and events; its
    synchronize() is counted."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class SimulatedCuda(CPU_Accelerator):
        _stream = _Stream()

        def is_synchronized_device(self):
            return False

        def synchronize(self, device_index=None):
            _note_read("accelerator.synchronize")

        @property
        def Stream(self):
            return _Stream

        @property
        def Event(self):
            return _Event

        def stream(self, stream):
            return contextlib.nullcontext()

        def current_stream(self, device_index=None):
            return self._stream

        def default_stream(self, device_index=None):
            return self._stream

    return SimulatedCuda()


def _record_stream(tensor, stream) -> None:
    """Tensor.record_stream with a simulated stream: nothing to record on CPU."""
    if not isinstance(stream, _Stream):
        return _original_record_stream(tensor, stream)


_original_record_stream = torch.Tensor.record_stream


def _blocking_copy(factory, device_position: int | None):
    """torch.tensor / torch.as_tensor: host data given a device is a blocking copy on CUDA (`device_position`: where
    the device may come among the positional arguments after the data)."""
    def made(data, *args, **kwargs):
        device = kwargs.get("device", args[device_position] if device_position is not None
                            and len(args) > device_position else None)
        if device is not None and not isinstance(data, torch.Tensor):
            _note_read(f"torch.{factory.__name__}(host data, device=...)")
        return factory(data, *args, **kwargs)
    return made


def _in_phase(phase: str, fn):
    @functools.wraps(fn)   # (inspect.getsource still sees fn: deepspeed_internals.zero_methods_unchanged)
    def wrapped(*args, **kwargs):
        if not _active:
            return fn(*args, **kwargs)
        counter = _active[-1]
        outer, counter.phase = counter.phase, phase
        try:
            return fn(*args, **kwargs)
        finally:
            counter.phase = outer
    return wrapped


def _phase_targets() -> list[tuple[object, str, str]]:
    """(owner, attribute, phase): the functions each phase runs in."""
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from moe_scale import deepspeed_internals
    from moe_scale.train import engine

    return [(DeepSpeedEngine, "forward", "forward"), (DeepSpeedEngine, "backward", "backward"),
            (DeepSpeedEngine, "step", "optimizer"),
            (engine, "reduce_gradients_in_place", "backward"), (engine, "expert_aware_clip_", "clip"),
            (DeepSpeedZeroOptimizer, "scaled_global_norm", "clip"),
            (DeepSpeedZeroOptimizer, "unscale_and_clip_grads", "clip"),
            (deepspeed_internals, "_unscale_and_clip_grads", "clip"),   # (what replaces it on moe_scale's engines)
            (bf16_optimizer, "get_global_norm_of_tensors", "clip"),
            (bf16_optimizer, "get_norm_with_moe_layers", "clip"),
            (bf16_optimizer, "clip_tensors_by_global_norm", "clip")]


COUNTED_STEP, STEPS = 5, 6   # step 5 of 6: after DeepSpeed's lazy set-up and the loop's timing warm-up (3 steps)


def run_flags(out: Path) -> list[str]:
    """The run around the counted step: no log, eval or checkpoint point before the last step."""
    return ["--max-steps", str(STEPS), "--log-interval", "1000", "--eval-interval", "1000", "--eval-max-batches", "1",
            "--checkpoint-interval", "0", "--out", str(out), "--overwrite"]


def count_training(model_flags: list[str], out: Path) -> dict:
    """`moe-scale train MODEL_FLAGS` (run in `out`, its stdout sent to stderr) with its step COUNTED_STEP counted:
    this rank's report."""
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"   # the simulation runs on CPU tensors whatever the machine has
    from moe_scale.cli import main

    results: list[dict] = []
    with counting_step(COUNTED_STEP, results), contextlib.redirect_stdout(sys.stderr):
        status = main(["train", *model_flags, *run_flags(out)])
    if status or not results:
        raise RuntimeError(f"moe-scale train {' '.join(model_flags)} failed (exit status {status})")
    return results[0]


def main(argv: list[str]) -> int:
    """Entry for a process of its own (tools/count_step_syncs.py's ranks, the tests): argv = REPORT_FILE OUT_DIR
    TRAIN_FLAGS...; writes this rank's report to REPORT_FILE (suffixed .rank<r> where several ranks run)."""
    import json
    import os

    report, out, flags = Path(argv[0]), Path(argv[1]), argv[2:]
    counts = count_training(flags, out)
    if os.environ.get("WORLD_SIZE", "1") != "1":
        report = report.with_name(f"{report.name}.rank{os.environ['RANK']}")
    report.write_text(json.dumps(counts))
    return 0


@contextlib.contextmanager
def counting_step(counted_step: int, results: list[dict]):
    """Within this block, `moe-scale train` counts its step `counted_step` (1-based) into `results` (one report)."""
    import deepspeed.accelerator as ds_accelerator

    from moe_scale.moe.kernel_policy import gpu_decisions
    from moe_scale.train import loop

    state = {"counter": None}
    real_step, real_points = loop._step, loop._points

    def step(ctx, train_state, report):
        if train_state.step + 1 == counted_step:
            state["counter"] = StepCounter()
            state["stack"] = contextlib.ExitStack()
            state["stack"].enter_context(state["counter"])
            state["stack"].enter_context(one_kernel_lstm(state["counter"]))
            state["stack"].enter_context(mock.patch.object(torch.cuda, "synchronize",
                                                           lambda *a, **k: _note_read("torch.cuda.synchronize")))
            _active.append(state["counter"])
        return real_step(ctx, train_state, report)

    def points(ctx, train_state, report, stop):
        try:
            return real_points(ctx, train_state, report, stop)
        finally:
            if state["counter"] is not None and train_state.step == counted_step:
                _active.pop()
                state["stack"].close()
                results.append(state["counter"].report())
                state["counter"] = None

    previous = ds_accelerator.get_accelerator()
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: state.get("stack") and state["stack"].close())   # a run that failed mid-step
        stack.callback(_active.clear)
        ds_accelerator.set_accelerator(simulated_cuda())
        stack.callback(ds_accelerator.set_accelerator, previous)
        stack.enter_context(gpu_decisions())
        stack.enter_context(mock.patch.object(loop, "_step", step))
        stack.enter_context(mock.patch.object(loop, "_points", points))
        stack.enter_context(mock.patch.object(torch.Tensor, "record_stream", _record_stream))
        stack.enter_context(mock.patch.object(torch, "tensor", _blocking_copy(torch.tensor, None)))
        stack.enter_context(mock.patch.object(torch, "as_tensor", _blocking_copy(torch.as_tensor, 1)))
        for owner, name, phase in _phase_targets():
            stack.enter_context(mock.patch.object(owner, name, _in_phase(phase, getattr(owner, name))))
        yield
