"""Every contract between moe_scale's expert layers and DeepSpeed's engine, in one place.

DeepSpeed recognises MoE layers with `isinstance(module, deepspeed.moe.layer.MoE)`; that decides how expert
gradients are reduced (over the expert-data-parallel group only), how ZeRO partitions expert parameters, and
how checkpoints are written (one file per global expert). `ExpertParallelModule` subclasses it for that check
only (none of DeepSpeed's gate or dispatch code runs) and provides what the engine reads:

- `num_experts`, `num_local_experts`, `ep_size`, `expert_group_name`, and `set_deepspeed_parallelism()`, which
  builds (or finds) the expert-parallel and data-parallel groups and hands them to the layer's `connect`;
- expert parameters flagged `allreduce=False` with `group_name` (DeepSpeed's `is_moe_param`);
- state-dict keys `deepspeed_moe.experts.deepspeed_experts.<local id>.<name>` for expert weights (its per-expert
  checkpoint files are keyed by that pattern) and no "expert" in any other key. Expert weights are stacked
  [L, ...]; two state-dict hooks present them per expert and stack them back. Other parameters that live with
  the experts (the hierarchical gate's secondary matrices, [A/P, D, G]: column j of group i belongs to expert
  i*G + j) are `ExpertShard`s too, checkpointed in their experts' files the same way.

A parameter held as copies on several ranks of an expert-parallel group (the hierarchical gate's secondary
matrices under --etp-size) is flagged `ds_pipe_replicated` on every copy but the first (`mark_copies`): DeepSpeed's
gradient norms (ZeRO, bf16, fp16, and train/clipping.py's) skip such parameters, so the norm counts it once.

DeepSpeed's group helpers are private; moe_scale/deepspeed_internals.py holds them with every other private name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.runtime.constants import PIPE_REPLICATED
from torch import nn

from moe_scale.deepspeed_internals import expert_parallel_groups
from moe_scale.distributed.subgroups import tensor_parallel_group

DS_EXPERT_PREFIX = "deepspeed_moe.experts.deepspeed_experts."
STACKED_PREFIX = "experts."


@dataclass(frozen=True)
class ExpertShard:
    """A parameter split over the expert-parallel ranks along dim 0: `per_rank` of its `total` rows on each.
    A row holds `experts_per_row` consecutive experts, indexed by its last dim (1: the row is one expert)."""

    param: nn.Parameter
    per_rank: int
    total: int
    experts_per_row: int = 1

    def per_expert(self, value: torch.Tensor) -> torch.Tensor:
        """[local experts, ...]: one entry per local expert."""
        if self.experts_per_row == 1:
            return value
        return value.movedim(-1, 1).reshape(value.shape[0] * self.experts_per_row, *value.shape[1:-1])

    def from_per_expert(self, per_expert: torch.Tensor) -> torch.Tensor:
        if self.experts_per_row == 1:
            return per_expert
        rows = per_expert.shape[0] // self.experts_per_row
        return per_expert.reshape(rows, self.experts_per_row, *per_expert.shape[1:]).movedim(1, -1).contiguous()


def mark_copies(params) -> None:
    """These parameters are copies of another rank's: the gradient norm leaves them out (DeepSpeed's flag for
    parameters pipeline parallelism replicates)."""
    for param in params:
        setattr(param, PIPE_REPLICATED, True)


@dataclass
class ParallelGroups:
    """The process groups an expert layer works with (None: one process)."""

    expert_parallel: object        # the ranks that split this layer's experts (tokens travel among them)
    data_parallel: object          # the ranks whose batches make up the global batch (balance statistics)
    expert_data_parallel: object   # the ranks that hold copies of the same experts (their gradients' sum)
    expert_parallel_rank: int
    expert_tensor_parallel: object = None   # --etp-size: the ranks holding shards of the same experts (None: 1)


class ExpertParallelModule(DeepSpeedMoE):
    """Base of every module whose `experts` DeepSpeed must treat as expert parameters (the MoE FFN layer, MoA's
    attention experts). Subclasses call `init_expert_parallel` in their __init__, build `self.experts`, call
    `mark_expert_parameters`, and implement `connect(groups)`."""

    def init_expert_parallel(self, num_experts: int, ep_size: int, ep_rank: int, tensor_parallel: int = 1) -> None:
        """`ep_size` ranks hold one copy of every expert, this one at `ep_rank` among them; with `tensor_parallel`
        T > 1 (--etp-size) each expert's hidden units are split over T consecutive ranks, so the ep_size / T
        expert-parallel ranks' experts each span T of them (`expert_rank`, `hidden_shard`). DeepSpeed sees the
        whole group of ep_size ranks (its checkpoint names each (expert, shard) as an expert of its own)."""
        nn.Module.__init__(self)   # DeepSpeed's MoE.__init__ would build its own gate and experts
        if ep_size % tensor_parallel:
            raise ValueError(f"ep_size={ep_size} ranks do not split into tensor-parallel groups of {tensor_parallel}")
        if num_experts % (ep_size // tensor_parallel):
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size // tensor_parallel}")
        self.num_experts, self.ep_size, self.ep_rank = num_experts, ep_size, ep_rank
        self.tensor_parallel = tensor_parallel
        self.num_local_experts = num_experts // (ep_size // tensor_parallel)
        self.expert_group_name = f"ep_size_{ep_size}"
        self.groups: ParallelGroups | None = None
        self._checkpoint_key_hooks = (
            self._register_state_dict_hook(_stacked_to_per_expert_keys),
            self._register_load_state_dict_pre_hook(_per_expert_to_stacked_keys, with_module=True))

    @property
    def expert_parallel_size(self) -> int:
        """Ranks holding different experts (--ep-size): the balance per rank counts over these."""
        return self.ep_size // self.tensor_parallel

    @property
    def expert_rank(self) -> int:
        """Which of the expert_parallel_size ranks' experts this rank holds (a shard of, with --etp-size)."""
        return self.ep_rank // self.tensor_parallel

    @property
    def hidden_shard(self) -> int:
        """Which of the tensor_parallel shards of its experts' hidden units this rank holds."""
        return self.ep_rank % self.tensor_parallel

    def use_module_path_keys(self) -> None:
        """State-dict keys by module path (experts.w_in, stacked), not DeepSpeed's per-expert checkpoint names:
        for loaders outside DeepSpeed (transformers' from_pretrained of an exported model)."""
        for hook in self._checkpoint_key_hooks:
            hook.remove()

    def expert_shards(self) -> dict[str, ExpertShard]:
        """Every parameter split over the expert-parallel ranks, by its name in this module: the experts' own
        (subclasses add what else lives with them)."""
        return {STACKED_PREFIX + name: ExpertShard(param, self.num_local_experts, self.num_experts)
                for name, param in self.experts.named_parameters()}

    def shard_copies(self) -> list[nn.Parameter]:
        """Those of expert_shards' parameters that each of the --etp-size ranks sharing an expert rank holds whole
        (a copy, `mark_copies`): none here (HierarchicalMoELayer: its groups' secondary gates)."""
        return []

    def mark_expert_parameters(self) -> None:
        for shard in self.expert_shards().values():
            shard.param.allreduce = False
            shard.param.group_name = self.expert_group_name

    # Called by deepspeed.initialize (and by tests) once torch.distributed is up.
    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        expert_parallel, data_parallel, expert_data_parallel, actual_rank = expert_parallel_groups(
            self.expert_group_name, self.ep_size, use_data_before_expert_parallel_)
        if actual_rank != self.ep_rank:
            raise RuntimeError(f"built for expert-parallel rank {self.ep_rank}, but DeepSpeed placed this "
                               f"process at rank {actual_rank} of its expert-parallel group")
        self.groups = ParallelGroups(expert_parallel, data_parallel, expert_data_parallel, actual_rank,
                                     tensor_parallel_group(expert_parallel, self.tensor_parallel))
        self.connect(self.groups)

    def connect(self, parallel: ParallelGroups) -> None:
        raise NotImplementedError

    def require_groups(self) -> None:
        if self.ep_size > 1 and self.groups is None:
            raise RuntimeError("ep_size > 1 needs set_deepspeed_parallelism() (deepspeed.initialize calls it)")


def expert_data_parallel_groups(model: nn.Module) -> dict[str, object]:
    """{expert group name: the expert-data-parallel group} of the model's expert layers, once DeepSpeed has
    placed them (`set_deepspeed_parallelism`)."""
    found = {}
    for module in model.modules():
        if isinstance(module, ExpertParallelModule):
            if module.groups is None:
                raise RuntimeError("expert groups are built by set_deepspeed_parallelism() (deepspeed.initialize "
                                   "calls it)")
            found[module.expert_group_name] = module.groups.expert_data_parallel
    return found


def _per_expert_key(prefix: str, name: str, local_id: int) -> str:
    return f"{prefix}{DS_EXPERT_PREFIX}{local_id}.{name.removeprefix(STACKED_PREFIX)}"


def _stacked_to_per_expert_keys(module: ExpertParallelModule, state_dict, prefix, local_metadata):
    for name, shard in module.expert_shards().items():
        per_expert = shard.per_expert(state_dict.pop(prefix + name))
        for local_id in range(per_expert.shape[0]):
            state_dict[_per_expert_key(prefix, name, local_id)] = per_expert[local_id]
    return state_dict


def _per_expert_to_stacked_keys(module: ExpertParallelModule, state_dict, prefix, local_metadata, strict,
                                missing_keys, unexpected_keys, error_msgs):
    for name, shard in module.expert_shards().items():
        keys = [_per_expert_key(prefix, name, i) for i in range(module.num_local_experts)]
        if all(key in state_dict for key in keys):
            state_dict[prefix + name] = shard.from_per_expert(torch.stack([state_dict.pop(key) for key in keys]))
