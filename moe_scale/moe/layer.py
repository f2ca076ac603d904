"""The MoE layer: router ─▶ dispatcher ─▶ experts ─▶ dispatcher, wired into DeepSpeed.

Legend: N tokens, D model dim, E global experts, K experts per token.

DeepSpeed recognises MoE layers with `isinstance(module, deepspeed.moe.layer.MoE)`; that decides how
expert gradients are reduced (over the expert-data-parallel group only), how ZeRO partitions expert
parameters, and how checkpoints are written (one file per global expert). We subclass it for that check
only: none of DeepSpeed's gate/dispatch code runs here. What the engine reads from us:

- `num_experts`, `num_local_experts`, `ep_size`, `expert_group_name`, and `set_deepspeed_parallelism()`;
- expert parameters flagged `allreduce=False` with `group_name` (DeepSpeed's `is_moe_param`);
- state-dict keys `deepspeed_moe.experts.deepspeed_experts.<local id>.<name>` for expert weights (its
  per-expert checkpoint files are keyed by that pattern) and no "expert" in any other key.
  Our weights are stacked [L, ...]; two state-dict hooks present them per expert and stack them back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.utils import groups
from torch import nn

from moe_scale.distributed.comm import RowGatherer, autograd_all_reduce_sum, collective_device
from moe_scale.distributed.launch import ranks_per_node
from moe_scale.moe.dispatch import AllToAllDispatcher
from moe_scale.moe.exchange import HierarchicalExchange, build_hierarchical_groups
from moe_scale.moe.experts import GroupedExperts
from moe_scale.moe.routers import NoisyTopKRouter

_DS_EXPERT_PREFIX = "deepspeed_moe.experts.deepspeed_experts."
_STACKED_PREFIX = "experts."


@dataclass
class MoEStats:
    """Balance statistics of the last forward, over the whole data-parallel batch (detached)."""

    importance_E: torch.Tensor
    load_E: torch.Tensor
    metrics: dict[str, float | torch.Tensor]   # the router's own numbers (e.g. threshold agreement)


class MoELayer(DeepSpeedMoE):
    """Sparsely-gated MoE of one-hidden-layer ReLU experts (Shazeer et al. 2017).

    The router defaults to noisy top-k with k experts per token; pass any other router (moe/gates.py).
    """

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, k: int, ep_size: int = 1,
                 ep_rank: int = 0, w_importance: float = 0.1, w_load: float = 0.1, noisy_gating: bool = True,
                 seed: int = 0, router: nn.Module | None = None, recompute: bool = False,
                 dispatch_mode: str = "dropless", capacity_factor: float = 1.0, all_to_all: str = "flat",
                 node_size: int = 0, reuse_grad_buffers: bool = True):
        nn.Module.__init__(self)  # DeepSpeed's MoE.__init__ would build its own gate and experts
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
        self.num_experts, self.ep_size, self.k = num_experts, ep_size, k
        self.num_local_experts = num_experts // ep_size
        self.ep_rank = ep_rank
        self.expert_group_name = f"ep_size_{ep_size}"
        self.router = router if router is not None else NoisyTopKRouter(
            d_model, num_experts, k, w_importance=w_importance, w_load=w_load, noisy=noisy_gating)
        self.experts = GroupedExperts(self.num_local_experts, d_model, d_hidden,
                                      first_global_expert=ep_rank * self.num_local_experts, seed=seed,
                                      recompute=recompute, reuse_grad_buffers=reuse_grad_buffers)
        for param in self.experts.parameters():
            param.allreduce = False
            param.group_name = self.expert_group_name
        self.dispatcher = AllToAllDispatcher(num_experts, self.num_local_experts, dispatch_mode, capacity_factor)
        if all_to_all not in ("flat", "hierarchical"):
            raise ValueError(f"all_to_all must be 'flat' or 'hierarchical', got {all_to_all!r}")
        self.all_to_all, self.node_size = all_to_all, node_size
        self.stats: MoEStats | None = None
        self.data_parallel_group = None
        self._register_state_dict_hook(_stacked_to_per_expert_keys)
        self._register_load_state_dict_pre_hook(_per_expert_to_stacked_keys, with_module=True)

    # Called by deepspeed.initialize (and by tests) once torch.distributed is up.
    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(
                self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        ep_group = groups._get_expert_parallel_group(self.expert_group_name)
        self.dispatcher.ep_group = ep_group
        if self.all_to_all == "hierarchical" and self.ep_size > 1:
            intra, inter, per_node, nodes = build_hierarchical_groups(ep_group, ranks_per_node(self.node_size))
            self.dispatcher.exchange = HierarchicalExchange(ep_group, intra, inter, per_node, nodes,
                                                            self.dispatcher.exchange.timer)
        actual_ep_rank = groups._get_expert_parallel_rank(self.expert_group_name)
        if actual_ep_rank != self.ep_rank:
            raise RuntimeError(f"built for expert-parallel rank {self.ep_rank}, but DeepSpeed placed this "
                               f"process at rank {actual_ep_rank} of its expert-parallel group")
        data_parallel = self.data_parallel_group = groups._get_data_parallel_group()
        self.router.sum_over_batch = autograd_all_reduce_sum(data_parallel)
        if hasattr(self.router, "gather_over_batch"):   # gates that select over the global batch
            gatherer = RowGatherer(data_parallel)
            self.router.gather_over_batch, self.router.rank_in_batch = gatherer, gatherer.position

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_ND, aux_loss)."""
        if self.ep_size > 1 and self.dispatcher.ep_group is None:
            raise RuntimeError("ep_size > 1 needs set_deepspeed_parallelism() (deepspeed.initialize calls it)")
        route = self.router(x_ND)
        self.stats = MoEStats(route.importance_E.detach(), route.load_E.detach(), dict(route.metrics))
        token_index_P, expert_P, gate_P = route.pairs()
        rows_RD, state = self.dispatcher.dispatch_rows(x_ND, token_index_P, expert_P, gate_P)
        if self.dispatcher.mode == "capacity":
            self.stats.metrics["dropped_fraction"] = self._dropped_fraction(state)
        # The experts gather each arrived pair's row and return the gate-weighted sum per row.
        per_row_RD = self.experts(rows_RD, (state.tokens_per_expert_L, state.tokens_per_expert),
                                  state.arrived_row_M, self.dispatcher.pair_gates(gate_P, state))
        return self.dispatcher.combine_rows(per_row_RD, state).to(x_ND.dtype), route.aux_loss

    def _dropped_fraction(self, state) -> torch.Tensor:
        """Dropped copies / routed copies over the whole data-parallel batch (a device scalar, read with the
        other metrics at log intervals)."""
        counts = torch.empty(2, dtype=torch.float64, device=collective_device())
        counts[0], counts[1] = state.dropped_pairs, state.num_pairs   # fills: no host-to-device copy
        if self.data_parallel_group is not None and dist.get_world_size(self.data_parallel_group) > 1:
            dist.all_reduce(counts, group=self.data_parallel_group)
        return counts[0] / counts[1].clamp(min=1)


def _stacked_to_per_expert_keys(module: MoELayer, state_dict, prefix, local_metadata):
    for name, _ in module.experts.named_parameters():
        stacked = state_dict.pop(prefix + _STACKED_PREFIX + name)
        for local_id in range(stacked.shape[0]):
            state_dict[f"{prefix}{_DS_EXPERT_PREFIX}{local_id}.{name}"] = stacked[local_id]
    return state_dict


def _per_expert_to_stacked_keys(module: MoELayer, state_dict, prefix, local_metadata, strict, missing_keys,
                                unexpected_keys, error_msgs):
    for name, _ in module.experts.named_parameters():
        keys = [f"{prefix}{_DS_EXPERT_PREFIX}{i}.{name}" for i in range(module.num_local_experts)]
        if all(key in state_dict for key in keys):
            state_dict[prefix + _STACKED_PREFIX + name] = torch.stack([state_dict.pop(key) for key in keys])
