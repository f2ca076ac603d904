"""Run by every Python process of tools/gpu_check.sh (this folder is first on its PYTHONPATH): stacks while it runs,
and, where asked, fewer Triton autotune candidates.

- Every GPU_CHECK_STACK_PERIOD seconds (default 20) all threads' Python stacks go to the file GPU_CHECK_STACKS
  (the check's log; standard error where unset), so a hang shows where, in pytest, the trainer, the benchmarks and
  every child they start. With PYTHONFAULTHANDLER=1 the SIGABRT that `timeout -s ABRT` sends at a stage's limit
  prints them once more, on standard error.
- GPU_CHECK_TRITON_CONFIGS=N keeps the first N candidates of every `triton.autotune` (DeepSpeed's grouped GEMM
  times 6 per shape, each compiled first: about a minute per layer shape from a cold cache).
A sitecustomize that this one shadows (Debian's python ships one) still runs: it is looked up further along sys.path.
"""

import faulthandler
import importlib.abc
import importlib.util
import os
import sys

_period = float(os.environ.get("GPU_CHECK_STACK_PERIOD") or 20)
_path = os.environ.get("GPU_CHECK_STACKS")
_stacks = open(_path, "a", buffering=1) if _path else sys.stderr   # kept open: faulthandler writes to its fd
if _period > 0 and _stacks is not None:
    faulthandler.dump_traceback_later(_period, repeat=True, file=_stacks)


class _FewerTritonConfigs(importlib.abc.MetaPathFinder):
    """Patches `triton.autotune` once triton is imported, before anything can decorate a kernel with it."""

    def __init__(self, keep: int):
        self.keep = keep

    def find_spec(self, name, path=None, target=None):
        if name != "triton":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, keep = spec.loader.exec_module, self.keep

        def exec_and_patch(module):
            exec_module(module)
            autotune = module.autotune
            module.autotune = lambda configs, *args, **kwargs: autotune(list(configs)[:keep], *args, **kwargs)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("GPU_CHECK_TRITON_CONFIGS", "").isdigit() and int(os.environ["GPU_CHECK_TRITON_CONFIGS"]) > 0:
    sys.meta_path.insert(0, _FewerTritonConfigs(int(os.environ["GPU_CHECK_TRITON_CONFIGS"])))


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for folder in sys.path:
        path = os.path.join(folder or ".", "sitecustomize.py")
        if os.path.abspath(folder or ".") != here and os.path.isfile(path):
            with open(path) as f:
                exec(compile(f.read(), path, "exec"), {"__name__": "sitecustomize", "__file__": path})
            return


_run_shadowed()
