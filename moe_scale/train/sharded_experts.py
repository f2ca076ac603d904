"""A run trained with --etp-size read back as whole experts (eval, generate, export, prune-heads, upcycling).

DeepSpeed's checkpoint keeps each (expert, shard) as an expert file of its own: rank (r T + s) of the
expert-model-parallel group, which holds shard s of expert-parallel rank r's L experts, names its local expert l
unit (r T + s) L + l (moe/layer.py's shard_pairs). A model of whole experts (any --ep-size, one shard) takes expert
e = r L + l as its shards joined along the hidden units: the first layer's rows by the kind's join_hidden (a gated
kind's gate and up rows apart), the second layer's rows in order; what lives beside the experts without hidden
units (the hierarchical gate's secondary matrices) is a copy in each shard's file, read from the first. The
non-expert weights are DeepSpeed's module file's, the vocabulary rows a split run kept in its portable files as a
plain checkpoint's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from moe_scale.config import RunConfig
from moe_scale.deepspeed_internals import MODEL_STATES_FILE, expert_states_file
from moe_scale.moe.deepspeed_adapter import DS_EXPERT_PREFIX, STACKED_PREFIX, ExpertParallelModule


def whole_experts(config: RunConfig) -> RunConfig:
    """The run's config with whole experts: what one process (or any --ep-size) builds to read it."""
    whole = copy.deepcopy(config)
    whole.moe.experts.tensor_parallel = 1
    return whole


def sharded_state(model: torch.nn.Module, checkpoint: Path, run: RunConfig) -> dict[str, torch.Tensor]:
    """The state dict of `model` (whole experts, any expert-parallel rank) from `run`'s sharded checkpoint: the
    module file's entries, and each local expert joined from its shards."""
    shards, experts_per_rank = run.etp_size, run.moe.experts.num_experts // run.parallel.ep_size
    state = dict(torch.load(checkpoint / MODEL_STATES_FILE, map_location="cpu", weights_only=False)["module"])
    layer_id = 0
    for prefix, module in model.named_modules():
        if not isinstance(module, ExpertParallelModule):
            continue
        kind = module.experts.kind
        names = [name.removeprefix(STACKED_PREFIX) for name in module.expert_shards()]
        for local in range(module.num_local_experts):
            expert = module.expert_rank * module.num_local_experts + local
            rank, index = divmod(expert, experts_per_rank)
            parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
            for shard in range(shards):
                unit = (rank * shards + shard) * experts_per_rank + index
                saved = torch.load(expert_states_file(checkpoint, layer_id, unit), map_location="cpu",
                                   weights_only=False)
                for name in names:
                    parts[name].append(saved[f"{prefix}.{DS_EXPERT_PREFIX}{unit}.{name}"])
            key = f"{prefix}.{DS_EXPERT_PREFIX}{local}."
            for name, values in parts.items():   # beside the weights: a copy with each shard (the first's)
                state[key + name] = values[0]
            state[key + "w_in"] = kind.join_hidden([w[None] for w in parts["w_in"]])[0]
            state[key + "w_out"] = torch.cat(parts["w_out"])
        layer_id += 1
    return state
