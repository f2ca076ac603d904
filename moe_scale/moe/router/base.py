"""What every router is and returns: the contract between a gate and the layer that routes with it.

Legend (docs/shapes.md): N tokens, D model dim, E experts, K experts per token, C (token, expert) pairs.

A router maps token rows x_ND to a `RouterOutput`: the (token, expert, gate) pairs, the balancing loss and the
balance statistics over the whole data-parallel batch. The base class owns the gate's precision: `forward` runs
the subclass's `route` on x in float32 at least (float64 stays float64, for gradcheck) with autocast off, so a
bf16 run cannot round the logits. A router never talks to the network itself: `connect(batch)` (called once by
the layer) hands it the data-parallel group's collectives (`BatchCollectives`: an autograd-aware sum, a row gather);
until then it is one process. Noise comes from `noise_sampler` (None: the global RNG). A gate that balances by
state updated between optimizer steps (aux_free's routing biases) sets `balances_after_step`; the training loop
calls its `begin_step` before a step's micro-batches and `after_step` once the optimizer has stepped.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from moe_scale.distributed.comm import BatchCollectives
from moe_scale.moe.router.noise import NoiseSampler, sample_noise


@contextmanager
def gating_precision(x: Tensor) -> Iterator[Tensor]:
    """x in float32 at least (float64 stays float64), with autocast off for the block."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        yield x.to(torch.promote_types(x.dtype, torch.float32))


@dataclass
class RouterOutput:
    """What every gate returns: its routing as (token, expert, gate) pairs, and its balance."""

    token_C: Tensor    # int64 [C], the row of x_ND of each pair, ascending
    expert_C: Tensor   # int64 [C], the pair's global expert id
    gate_C: Tensor     # float32 [C], the pair's gate (carries the router's task-loss gradient)
    aux_loss: Tensor   # scalar, the gate's balancing loss
    importance_E: Tensor   # float32 [E], summed gates over the whole data-parallel batch
    load_E: Tensor     # float32 [E], smooth load (noisy gates in training) or hard count, whole batch
    metrics: dict[str, float | Tensor] = field(default_factory=dict)   # gate-specific numbers (read at log points)
    top_k: Optional[int] = None   # every token has top_k pairs, token-major in descending logit order; None:
                                  # a token gets a variable number of experts (batchwise)
    local_gates_E: Optional[Tensor] = None   # this rank's gates summed per expert, before the data-parallel sum
                                             # (None: not computed; the layer sums the pairs' gates itself)

    @classmethod
    def from_top_k(cls, gates_NK: Tensor, experts_NK: Tensor, aux_loss: Tensor, importance_E: Tensor,
                   load_E: Tensor, metrics: Optional[dict] = None, local_gates_E: Optional[Tensor] = None
                   ) -> "RouterOutput":
        """The routing of a gate that gives every token K experts."""
        n, k = experts_NK.shape
        token_C = torch.arange(n, device=experts_NK.device).repeat_interleave(k, output_size=n * k)
        return cls(token_C, experts_NK.reshape(-1), gates_NK.reshape(-1), aux_loss, importance_E, load_E,
                   metrics or {}, k, local_gates_E)

    @property
    def gates_NK(self) -> Tensor:
        return self.gate_C.view(-1, self._per_token())

    @property
    def experts_NK(self) -> Tensor:
        return self.expert_C.view(-1, self._per_token())

    def _per_token(self) -> int:
        if self.top_k is None:
            raise AttributeError("this gate gives tokens a variable number of experts: read token_C / expert_C / "
                                 "gate_C")
        return self.top_k

    def with_experts(self, experts_NK: Tensor, gates_NK: Tensor) -> "RouterOutput":
        """The same routing with other experts and their gates (router replay, moe/route_tape.py); the balance
        losses and statistics stay the router's own."""
        self._per_token()
        return replace(self, expert_C=experts_NK.reshape(-1), gate_C=gates_NK.reshape(-1))

    def round_robin(self, num_experts: int) -> "RouterOutput":
        """The same routing with the experts replaced round-robin (pair c goes to expert c mod E: a token's K
        experts are distinct, and every expert gets the same number of pairs, give or take one); gates, losses and
        statistics are the router's (--force-balanced-routing)."""
        self._per_token()
        expert_C = torch.arange(self.expert_C.shape[0], device=self.expert_C.device).remainder_(num_experts)
        return replace(self, expert_C=expert_C)

    def pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """(token_C, expert_C, gate_C): what a dispatcher consumes."""
        return self.token_C, self.expert_C, self.gate_C


# What a gate owns besides its routing, asked of its class by the rest of moe_scale (the layer it needs, the FLOP
# count and the planner, eval, export): tests/moe/router/test_gate_registry.py walks every gate of GATES for each,
# and docs/moe-design.md's "Adding a gate" lists them.
GATE_OWNS = ("name", "section", "routes_around_the_exchange", "gating_counts", "dispatch_units", "active_experts",
             "expert_stats_in_one_process", "exports_as_mixtral")


class Router(nn.Module):
    """Base of every gate: its size, its top-k, its precision, and its link to the data-parallel batch; and, as
    class attributes and class methods of each gate, what the rest of moe_scale asks of it (GATE_OWNS)."""

    name = ""                            # its --gate value (router/build.py's GATES)
    section: Optional[str] = None        # its own RouterConfig subsection (its flags); None: it has none
    routes_around_the_exchange = False   # its second level runs beside the experts (HierarchicalMoELayer)
    expert_stats_in_one_process = False  # eval's per-expert report needs one process (pairs name other ranks' rows)
    takes_valid_rows = False   # route() takes valid_N [N] (False: a padding row, left out of its statistics)
    takes_seq_len = False      # route() takes seq_len: its rows are sequences of that many consecutive tokens
    balances_after_step = False   # begin_step() / after_step() do something (the training loop calls them)
    k_per_token = True         # its layer's route() gives every token k experts (recorded by moe/route_tape.py)
    replays = False            # gates_for(): the gate values of given experts (router replay, moe/route_tape.py)
    keep_scores = False        # (set by a replaying tape) route() keeps its scores for gates_for()

    @classmethod
    def gating_counts(cls, config, d_model: int, num_experts: int) -> tuple[int, int]:
        """(parameters of all ranks, forward multiply-adds per token) of the gate, for `flops` and `plan`."""
        raise NotImplementedError(f"{cls.__name__} does not count its parameters and MACs")

    @classmethod
    def dispatch_units(cls, config, num_experts: int) -> int:
        """What a token's rows are sent to (and counted per: the planner's units): its experts."""
        return num_experts

    @classmethod
    def active_experts(cls, config) -> int:
        """Experts that compute for one token."""
        return config.top_k

    @classmethod
    def exports_as_mixtral(cls, config) -> bool:
        """Whether transformers' Mixtral / Qwen2-MoE router computes this gate (a native export)."""
        return False

    def __init__(self, d_model: int, num_experts: int, k: int):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"router top-k must be in [1, num_experts={num_experts}], got k={k}")
        self.d_model, self.num_experts, self.k = d_model, num_experts, k
        self.batch = BatchCollectives()
        self.noise_sampler: Optional[NoiseSampler] = None

    def connect(self, batch: BatchCollectives) -> None:
        """Sum (and gather) over `batch`'s data-parallel group from now on."""
        self.batch = batch

    def forward(self, x_ND: Tensor, *args, **kwargs) -> RouterOutput:
        """`route` on x_ND in the gate's precision (further arguments are the gate's own, e.g. a padding mask)."""
        with gating_precision(x_ND) as x_ND:
            return self.route(x_ND, *args, **kwargs)

    def route(self, x_ND: Tensor) -> RouterOutput:
        """The gate on x_ND, already in the gate's precision."""
        raise NotImplementedError

    def begin_step(self) -> None:
        """An optimizer step's first micro-batch comes next (a gate that balances between steps starts its count)."""

    def after_step(self) -> None:
        """The optimizer step is done (a gate that balances between steps updates itself here, on the device)."""

    @staticmethod
    def small_init_(w: Tensor, d_model: int) -> Tensor:
        """The gates' start where they do not start at zero: N(0, (0.01 / sqrt(D))²), so every logit starts near 0
        whatever the width (routing near uniform, gradients alive)."""
        return nn.init.normal_(w, std=1e-2 / math.sqrt(d_model))

    @staticmethod
    def logits(x_ND: Tensor, w_DE: Tensor) -> Tensor:
        """x_ND @ w_DE in x's (the gate's) precision."""
        return x_ND @ w_DE.to(x_ND.dtype)

    def _sample_noise(self, n: int, e: int, device: torch.device) -> Tensor:
        return sample_noise(self.noise_sampler, n, e, device)

