"""What the forkserver of tests/forked.py imports once, so that every child it forks starts warm: torch,
DeepSpeed, every moe_scale command and what a run imports lazily (plots, TensorBoard, checkpoints). Imports
only: nothing here runs a torch op or starts a thread, so forking the server is safe."""

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
import moe_scale.train.checkpoint  # noqa: E402,F401
import moe_scale.train.evaluate  # noqa: E402,F401
import moe_scale.train.loop  # noqa: E402,F401
