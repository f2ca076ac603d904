"""Every DeepSpeed internal moe_scale relies on, in one place, for the DeepSpeed versions pyproject.toml allows.

Legend (docs/shapes.md): M rows sorted by local expert, L local experts, I input width, O output
width.

DeepSpeed has no public API for these: building and finding its expert-parallel process groups, switching off
the engine's stage-0 gradient all-reduce when ours does the same sums in place, reading ZeRO 1/2 and bf16
optimizer partitions (portable checkpoints), not building its CPU communication op, its checkpoint file names,
its Triton grouped GEMM, and two notices it prints in every process that tell a user nothing. An upgrade of
DeepSpeed reads this file and runs tests/test_deepspeed_internals.py, which checks that the installed DeepSpeed
still has every name in `PRIVATE_NAMES` and that no other module of moe_scale uses one.

Nothing here imports DeepSpeed at module level: DeepSpeed picks its accelerator when first imported, after
distributed/launch.py has selected it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_scale.errors import UserError

TESTED_VERSIONS = ">=0.19.8,<0.20"   # as pyproject.toml

# Each private name -> (the file of the deepspeed package that defines it, the text that shows it there): what
# tests/test_deepspeed_internals.py checks in the installed DeepSpeed.
PRIVATE_NAMES = {
    "_get_expert_parallel_group_dict": ("utils/groups.py", "def _get_expert_parallel_group_dict("),
    "_create_expert_and_data_parallel": ("utils/groups.py", "def _create_expert_and_data_parallel("),
    "_get_expert_parallel_rank": ("utils/groups.py", "def _get_expert_parallel_rank("),
    "_get_expert_parallel_group": ("utils/groups.py", "def _get_expert_parallel_group("),
    "_get_data_parallel_group": ("utils/groups.py", "def _get_data_parallel_group("),
    "_get_expert_data_parallel_group": ("utils/groups.py", "def _get_expert_data_parallel_group("),
    "enable_backward_allreduce": ("runtime/engine.py", "self.enable_backward_allreduce = True"),
    "dp_world_size": ("runtime/engine.py", "self.dp_world_size = "),
    "gradient_average": ("runtime/engine.py", "self.gradient_average = "),
    "communication_data_type": ("runtime/engine.py", "def communication_data_type(self)"),
    "postscale_gradients": ("runtime/engine.py", "def postscale_gradients(self)"),
    "gradient_predivide_factor": ("runtime/engine.py", "def gradient_predivide_factor(self)"),
    "global_steps": ("runtime/engine.py", "self.global_steps = "),
    "global_samples": ("runtime/engine.py", "self.global_samples = "),
    "single_partition_of_fp32_groups": ("runtime/zero/stage_1_and_2.py", "self.single_partition_of_fp32_groups"),
    "fp32_groups_flat_partition": ("runtime/bf16_optimizer.py", "self.fp32_groups_flat_partition"),
    "_hp_mapping": ("utils/tensor_fragment.py", "_hp_mapping"),
    "param_group_index": ("utils/tensor_fragment.py", "param_group_index"),
    "lp_fragment_address": ("utils/tensor_fragment.py", "lp_fragment_address"),
    "hp_fragment_address": ("utils/tensor_fragment.py", "hp_fragment_address"),
    "_dp_group": ("utils/mixed_precision_linkage.py", "lp_param._dp_group = "),
    "mp_rank_00_model_states.pt": ("runtime/engine.py", '"mp_rank_" + mp_rank_str + "_model_states.pt"'),
    "ShareMemCommBuilder": ("comm/torch.py", 'builder = get_accelerator().create_op_builder("ShareMemCommBuilder")'),
    "group_gemm_triton": ("ops/triton_ops/group_gemm_triton.py", ""),
    "_group_gemm": ("ops/triton_ops/group_gemm_triton.py", "def _group_gemm("),
    "_grouped_dw": ("ops/triton_ops/group_gemm_triton.py", "def _grouped_dw("),
    "_triton": ("ops/triton_ops/_triton.py", "def is_triton_available("),
    "built successfully": ("comm/torch.py", "print(f'DeepSpeed {builder.absolute_name()} built successfully')"),
    "all_gather_into_tensor": ("comm/torch.py", "return torch.distributed.all_gather_into_tensor"),
    "_model_parallel_all_reduce": ("runtime/zero/stage_1_and_2.py", "def _model_parallel_all_reduce(self, tensor, op)"),
}


# ---------------------------------------------------------------- expert-parallel process groups

def expert_parallel_groups(group_name: str, ep_size: int, use_data_before_expert_parallel: bool = False):
    """(expert-parallel group, data-parallel group, expert-data-parallel group, this rank in the expert-parallel
    group) of DeepSpeed's groups called `group_name`, created the first time (collective then)."""
    from deepspeed.utils import groups

    if group_name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size,
                                                use_data_before_expert_parallel_=use_data_before_expert_parallel)
    return (groups._get_expert_parallel_group(group_name), groups._get_data_parallel_group(),
            groups._get_expert_data_parallel_group(group_name), groups._get_expert_parallel_rank(group_name))


# ---------------------------------------------------------------- the engine

def backward_allreduce_is_plain_average(engine) -> bool | None:
    """None when the engine does not all-reduce gradients in its backward; else whether that all-reduce is a
    plain float32 sum divided by the data-parallel size (what `reduce_gradients_in_place` computes)."""
    if not engine.enable_backward_allreduce:
        return None
    return bool(engine.gradient_average and engine.postscale_gradients()
                and engine.gradient_predivide_factor() == 1.0 and engine.communication_data_type == torch.float32)


def engine_data_parallel_size(engine) -> int:
    return engine.dp_world_size


def disable_backward_allreduce(engine) -> None:
    engine.enable_backward_allreduce = False


def step_counters(engine) -> tuple[int, int]:
    """(optimizer steps, samples) the engine has counted."""
    return engine.global_steps, engine.global_samples


def set_step_counters(engine, steps: int, samples: int) -> None:
    engine.global_steps, engine.global_samples = steps, samples


# ---------------------------------------------------------------- optimizer partitions (ZeRO 1/2, bf16)

@dataclass(frozen=True)
class Fragment:
    """The part of a parameter this rank's flat fp32 partition holds: `numel` entries from `param_start` of the
    flattened parameter, at `partition_start` of parameter group `group_index`'s partition."""

    group_index: int
    param_start: int
    partition_start: int
    numel: int


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer whose state holds the moments (ZeRO and bf16 wrap it)."""
    optimizer = engine.optimizer
    return optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer


def flat_partition(engine, group_index: int) -> torch.Tensor | None:
    """This rank's flat fp32 partition of a parameter group (ZeRO 1/2, bf16); None for an optimizer without."""
    for name in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        if hasattr(engine.optimizer, name):
            return getattr(engine.optimizer, name)[group_index]
    return None


def is_partitioned(param: torch.nn.Parameter) -> bool:
    """Whether DeepSpeed keeps `param`'s fp32 master and moments in flat partitions (ZeRO 1/2 or bf16)."""
    return hasattr(param, "_hp_mapping")


def fragment(param: torch.nn.Parameter) -> Fragment | None:
    """This rank's fragment of a partitioned parameter; None where this rank holds none of it."""
    mapping = param._hp_mapping
    if mapping is None:
        return None
    lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
    return Fragment(mapping.param_group_index, lp.start, hp.start, lp.numel)


def partition_group(param: torch.nn.Parameter):
    """The data-parallel group a partitioned parameter's fragments are spread over."""
    return param._dp_group



# ---------------------------------------------------------------- a parameter's whole optimizer state

PARAM = "param"   # the fp32 value, beside the optimizer state's keys


def _flat_partition(engine, group_index: int) -> torch.Tensor:
    """This rank's flat fp32 partition of a parameter group (ZeRO 1/2, bf16): the base optimizer's key."""
    flat = flat_partition(engine, group_index)
    if flat is None:
        raise UserError(f"{type(engine.optimizer).__name__}: moe_scale cannot read this DeepSpeed optimizer's "
                        f"partitions to write a portable checkpoint")
    return flat


def _partitioned_tensors(engine, param) -> list[tuple[str, torch.Tensor]]:
    """(key, flat tensor) of the fp32 master and each optimizer state of the partition `param` lives in (keys
    in the same order on every rank: the optimizer's, sorted)."""
    base = base_optimizer(engine)
    ranks_state = [base.state.get(_flat_partition(engine, i), {}) for i in range(len(base.param_groups))]
    keys = sorted({k for state in ranks_state for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0})
    part = fragment(param)
    if part is None:
        return [(PARAM, None)] + [(k, None) for k in keys]
    flat = _flat_partition(engine, part.group_index)
    state = base.state.get(flat, {})
    return [(PARAM, flat)] + [(k, state.get(k)) for k in keys]


def full_optimizer_state(engine, param) -> dict[str, torch.Tensor]:
    """{PARAM: fp32 value, key: optimizer state} of one parameter, whole on every rank of its group."""
    if is_partitioned(param):   # ZeRO 1/2 or bf16 (no fragment where this rank holds none of it)
        state = {}
        part = fragment(param)
        for key, flat in _partitioned_tensors(engine, param):
            full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
            if flat is not None:
                full.narrow(0, part.param_start, part.numel).copy_(flat.narrow(0, part.partition_start, part.numel))
            dist.all_reduce(full, group=partition_group(param))   # each entry is held by exactly one rank
            state[key] = full.view(param.shape).cpu()
        return state
    own = base_optimizer(engine).state.get(param, {})
    state = {PARAM: param.detach().float().cpu()}
    state.update({k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in own.items()})
    return state


def any_flat_state(engine) -> dict:
    for state in base_optimizer(engine).state.values():
        if state:
            return state
    return {}


def set_optimizer_state(engine, param, state: dict, flat_step) -> None:
    """Sets one parameter's fp32 value and optimizer state from `state` (full_optimizer_state's form): this rank's
    fragment of them under ZeRO 1/2 or bf16, else the parameter's own."""
    value = state[PARAM]
    param.data.copy_(value.to(param.device, param.dtype))
    if is_partitioned(param):   # ZeRO 1/2 or bf16: this rank's fragment, if any
        part = fragment(param)
        if part is None:
            return
        flat = _flat_partition(engine, part.group_index)
        flat_state = base_optimizer(engine).state[flat]
        for key, full in state.items():
            target = flat if key == PARAM else flat_state.setdefault(key, torch.zeros_like(flat))
            target.data.narrow(0, part.partition_start, part.numel).copy_(
                full.flatten().narrow(0, part.param_start, part.numel))
        if flat_step is not None:
            flat_state["step"] = flat_step.clone() if torch.is_tensor(flat_step) else flat_step
        return
    own = {k: v.to(param.device).clone() if torch.is_tensor(v) else v for k, v in state.items() if k != PARAM}
    if own:
        base_optimizer(engine).state[param] = own


# ---------------------------------------------------------------- files

MODEL_STATES_FILE = "mp_rank_00_model_states.pt"   # a checkpoint's non-expert weights (one model-parallel rank)


def expert_states_file(checkpoint, moe_layer: int, expert: int):
    """The file of one expert of one MoE layer in a DeepSpeed checkpoint (DeepSpeedEngine._get_expert_ckpt_name's
    naming: the expert's global index in its expert-parallel group, the layer's index among the MoE modules)."""
    return checkpoint / f"layer_{moe_layer}_expert_{expert}_mp_rank_00_model_states.pt"


# ---------------------------------------------------------------- the CPU communication op, never built

@contextlib.contextmanager
def without_cpu_comm_op():
    """Within this block, initialising DeepSpeed's communication on its CPU accelerator builds, loads and maps
    nothing of its shared-memory all-reduce op.

    DeepSpeed 0.19.8's TorchBackend compiles that op the first time a machine initialises communication (about 30 s
    and a minute of CPU time on 2 cores), loads it in every process, and maps a 66 MB /dev/shm segment per rank that it
    never unlinks. Its only caller is `inference_all_reduce` (DeepSpeed's tensor-parallel inference), which uses
    torch.distributed.all_reduce without it; moe_scale never calls it, and its gradient reductions, all-gathers and
    all-to-alls are torch.distributed's (gloo) either way. The accelerator asked for the op's builder answers None,
    as CUDA's does."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    offered = accelerator.create_op_builder

    def create_op_builder(class_name: str):
        return None if class_name == "ShareMemCommBuilder" else offered(class_name)

    accelerator.create_op_builder = create_op_builder
    try:
        yield
    finally:
        del accelerator.create_op_builder   # the class's own method again


# ---------------------------------------------------------------- notices (moe_scale/console.py drops them)

# Printed on stdout by every process at every start where DeepSpeed loads an op (moe_scale's runs load none:
# `without_cpu_comm_op`; a user's own DeepSpeed code may): no news.
OP_LOADED_LINE = re.compile(r"DeepSpeed \S+ built successfully")

# ZeRO 1/2 gather their partitions with torch.distributed.all_gather_into_tensor, which torch 2.13 deprecates: a
# FutureWarning on every rank for DeepSpeed's developers. The table entry fails when DeepSpeed stops calling it.
DEPRECATED_GATHER_WARNING = r"`torch\.distributed\.all_gather_into_tensor` is deprecated"


# ---------------------------------------------------------------- Triton grouped GEMM

@functools.cache
def triton_grouped_gemm():
    """The module of DeepSpeed's Triton grouped GEMM (forward product `_group_gemm`, weight gradient
    `_grouped_dw`), or None without Triton."""
    try:
        ops = importlib.import_module("deepspeed.ops.triton_ops.group_gemm_triton")
        from deepspeed.ops.triton_ops._triton import is_triton_available
    except ImportError:
        return None
    return ops if is_triton_available() and hasattr(ops, "_group_gemm") and hasattr(ops, "_grouped_dw") else None


def triton_group_gemm(a_MI: torch.Tensor, b_LIO: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return triton_grouped_gemm()._group_gemm(a_MI, b_LIO, offsets)


def triton_grouped_dw(a_MI: torch.Tensor, b_MO: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return triton_grouped_gemm()._grouped_dw(a_MI, b_MO, offsets, offsets.shape[0])


# ---------------------------------------------------------------- ZeRO 1/2's gradient norm and clipping, on the device

# DeepSpeedZeroOptimizer's methods that `zero_norm_without_host_reads` replaces, with the sha256 (first 16 hex digits)
# of the source they replace: where the installed DeepSpeed's differs, nothing is replaced (DeepSpeed's own methods
# run, correct but reading the device) and tests/test_deepspeed_internals.py fails until the replacements are
# checked against the new source.
ZERO_NORM_METHODS = {"get_grad_norm_direct": "72af0993ad8cde2c", "unscale_and_clip_grads": "6bf2ce6f97eafcc2"}


def zero_methods_unchanged() -> bool:
    """Whether the installed DeepSpeed's methods are the ones the replacements were written from."""
    import hashlib
    import inspect

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return all(hashlib.sha256(inspect.getsource(getattr(DeepSpeedZeroOptimizer, name)).encode()).hexdigest()[:16]
               == digest for name, digest in ZERO_NORM_METHODS.items())


def zero_norm_without_host_reads(optimizer) -> bool:
    """On a ZeRO 1/2 optimizer, the gradient norm and clipping of its step without waiting for the device, with the
    same numbers (tests/test_deepspeed_internals.py): `get_grad_norm_direct` takes every gradient's norm in one
    fused call (torch._foreach_norm: one kernel launch per chunk of tensors, not a cast, a norm and a copy per
    parameter) and marks a non-finite norm -1 on the device (DeepSpeed fills it from a tensor it copies from the host,
    a blocking copy per parameter group); `unscale_and_clip_grads` makes an invalid norm infinite on the device
    (DeepSpeed asks the host, `bool()`, per parameter group). Returns whether they were installed: only on a
    DeepSpeedZeroOptimizer whose methods are the ones they were written from."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or not zero_methods_unchanged():
        return False
    # (looked up at each call, so that tools/step_syncs.py can tell the clipping phase by them)
    optimizer.get_grad_norm_direct = lambda *args, **kwargs: _grad_norm_direct(optimizer, *args, **kwargs)
    optimizer.unscale_and_clip_grads = lambda *args, **kwargs: _unscale_and_clip_grads(optimizer, *args, **kwargs)
    return True


def _grad_norm_direct(self, gradients, params, norm_type=2):
    """DeepSpeedZeroOptimizer.get_grad_norm_direct for the L2 norm (others: DeepSpeed's own)."""
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from torch import _foreach_norm   # torch's fused norms (the table above lists DeepSpeed's names)
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    grads = [g.detach() for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params)
             if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
             and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)]
    if grads:
        norms = torch.stack(_foreach_norm(grads, 2, dtype=get_norm_dtype()))
        total_norm = torch.dot(norms, norms).float()   # the sum of squares in one launch
    else:
        total_norm = torch.zeros((), dtype=torch.float32, device=self.device)
    dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
    # a sum of squares is >= 0, inf or NaN: its root is finite, or marked -1 as DeepSpeed marks it
    return total_norm.sqrt_().nan_to_num_(nan=-1.0, posinf=-1.0)


def _unscale_and_clip_grads(self, grad_groups_flat, total_norm):
    """DeepSpeedZeroOptimizer.unscale_and_clip_grads with an invalid (non-finite or negative) norm made infinite on
    the device: the same clipping factor, no read. DeepSpeed calls it once per parameter group with the same norm:
    the factor is computed once, and each call scales its gradients in one fused launch."""
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return
    key = (total_norm, getattr(total_norm, "_version", None), self.loss_scale, self.clip_grad)
    cached = getattr(self, "moe_scale_inverse_scale", None)
    if cached is None or not all(a is b or not (torch.is_tensor(a) or torch.is_tensor(b)) and a == b
                                     for a, b in zip(cached[0], key)):
        cached = self.moe_scale_inverse_scale = (key, _inverse_scale(self, total_norm))
    from torch import _foreach_mul_   # (one launch per chunk of tensors)

    grads = [g.data for grad in grad_groups_flat for g in (grad if isinstance(grad, list) else [grad])]
    if grads:
        _foreach_mul_(grads, cached[1])


def _inverse_scale(self, total_norm):
    """1 / DeepSpeed's combined scale (the loss scale, and the clipping factor where the norm is above the limit)."""
    combined_scale = self.loss_scale
    if self.clip_grad > 0.:
        clip_norm = torch.as_tensor(total_norm, dtype=torch.float, device=self.device)
        clip_norm = torch.where(clip_norm >= 0, clip_norm, float("inf"))   # NaN, -1 (DeepSpeed's mark): inf
        if self.loss_scale == 1.0:   # (x / 1 + 1e-6) / c and clamp(...) * 1: DeepSpeed's numbers, in fewer launches
            combined_scale = torch.clamp((clip_norm + 1e-6).div_(self.clip_grad), min=1.0)
        else:
            clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad
            combined_scale = torch.clamp(clip, min=1.0) * self.loss_scale
    return 1. / combined_scale
