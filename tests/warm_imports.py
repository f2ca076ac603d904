"""What the forkserver of tests/forked.py imports once, so that every child it forks starts warm: torch,
DeepSpeed, every moe_scale command and what a run imports lazily (plots, TensorBoard, checkpoints, DeepSpeed's
ZeRO optimizer check, which imports its Muon optimizer and with it torch's compiler: about 1 s a rank). Imports
only: nothing here runs a torch op or starts a thread, so forking the server is safe.

multiprocessing's forkserver swallows an ImportError of its preload and forks from a half-warm server without a
word (every child then pays the imports itself): the optional modules below are imported one by one, and
tests/test_harness.py checks that a child holds everything listed here."""

import importlib
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")   # DeepSpeed picks its accelerator from this on first use

import deepspeed  # noqa: E402,F401
import matplotlib.pyplot  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch.utils.cpp_extension  # noqa: E402,F401
import torch.utils.tensorboard  # noqa: E402,F401

import moe_scale.cli  # noqa: E402,F401
import moe_scale.inference.generate  # noqa: E402,F401
import moe_scale.inference.hf_export  # noqa: E402,F401
import moe_scale.inference.trained_run  # noqa: E402,F401
import moe_scale.metrics.plots  # noqa: E402,F401
import moe_scale.models.build  # noqa: E402,F401
import moe_scale.models.lstm_lm  # noqa: E402,F401
import moe_scale.train.checkpoint  # noqa: E402,F401
import moe_scale.train.evaluate  # noqa: E402,F401
import moe_scale.train.loop  # noqa: E402,F401

# Imported inside a run by DeepSpeed's engine and moe_scale's plots; a version that lacks one is not an error.
LAZY = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep_layer",
        "deepspeed.ops.op_builder", "scipy", "matplotlib.backends.backend_agg",
        "tensorboard.backend.event_processing.event_accumulator")
for _name in LAZY:
    try:
        importlib.import_module(_name)
    except ImportError:
        pass
