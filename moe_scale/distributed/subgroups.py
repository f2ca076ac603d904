"""Process groups inside an expert-parallel group that DeepSpeed does not build.

--etp-size T splits each expert's hidden units over T consecutive ranks of the expert-parallel group
(moe/deepspeed_adapter.py); a parameter the T ranks hold as copies (the hierarchical gate's secondary matrices)
sums its gradient over those T ranks: their tensor-parallel group.
"""

from __future__ import annotations

import torch.distributed as dist

_BUILT: dict[tuple[int, int], tuple[object, object]] = {}   # (id(expert-parallel group), T) -> (it, this rank's)


def tensor_parallel_group(expert_parallel_group, shards: int):
    """The group of this rank's `shards` consecutive ranks of its expert-parallel group (the ranks holding shards
    of the same experts); None with one shard. Collective the first time for a group (every rank creates every
    subgroup in the same order, as torch requires); the layers of one model share it."""
    if shards == 1:
        return None
    key = (id(expert_parallel_group), shards)
    if key not in _BUILT:
        ep_ranks = dist.get_process_group_ranks(expert_parallel_group)
        every: list[list[int]] = [None] * dist.get_world_size()   # type: ignore[list-item]
        dist.all_gather_object(every, ep_ranks)
        mine = None
        for ranks in sorted({tuple(g) for g in every}):
            for first in range(0, len(ranks), shards):
                members = list(ranks[first:first + shards])
                group = dist.new_group(members)
                if dist.get_rank() in members:
                    mine = group
        _BUILT[key] = (expert_parallel_group, mine)
    return _BUILT[key][1]
