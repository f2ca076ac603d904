"""Expert-balance statistics reported per MoE layer (Shazeer et al. Table 6).

Legend (docs/shapes.md): E experts.

CV is the coefficient of variation itself (not CV^2), population variance. One definition everywhere (the
training log, `eval`, summary.json's train and valid_* numbers, `eval --expert-stats`' per-layer block): over
the real tokens' routing, padding rows left out (moe/routed_layer.py), summed over every rank,
  importance   the gates of the (token, expert) pairs, summed per expert
  load         the pairs per expert: the tokens each expert received
The router's own load is something else: in training under noise its smooth estimator (Shazeer et al.
eq. 8-10), an expectation whose CV runs far below the counts'. Training reports its balance too, as
`cv_router_load` / `max_over_mean_router_load` (what the load loss balances; the paper's Table 6 column).

They are reported over all tokens of a logging interval (or of an evaluation pass), not per batch: with
many experts a small batch gives each expert a handful of tokens, and the sampling noise alone would put
the CV near 1/sqrt(tokens per expert) however well balanced the router is. The paper's batches held
~300k words; summing the vectors over an interval measures the router, not the batch size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_scale.distributed.comm import collective_device
from moe_scale.moe.losses import cv_squared


def load_balance(load_E: torch.Tensor) -> tuple[float, float]:
    """(CV, max / mean) of a load vector."""
    load = load_E.double()
    return float(cv_squared(load).sqrt()), float(load.max() / (load.mean() + 1e-10))


def balance_metrics(importance_E: torch.Tensor, load_E: torch.Tensor, ranks: int = 1) -> dict[str, float]:
    """CVs of importance and load, and the overload factors: the most loaded expert's load over the mean, and
    with `ranks` > 1 the most loaded expert-parallel rank's (its experts are consecutive) over the mean."""
    cv_load, max_over_mean = load_balance(load_E)
    out = {"cv_importance": float(cv_squared(importance_E.double()).sqrt()), "cv_load": cv_load,
           "max_over_mean_load": max_over_mean}
    if ranks > 1:
        out["max_over_mean_rank_load"] = load_balance(load_E.reshape(ranks, -1).sum(1))[1]
    return out


def overload_text(values: dict[str, float]) -> str:
    """The log line's balance: per MoE layer (`layer<i>_` keys), cv(load) and max/mean load per expert (and per
    rank)."""
    parts = []
    for key in (k for k in values if k.endswith("max_over_mean_load") and "router" not in k):
        prefix = key[:-len("max_over_mean_load")]
        rank = values.get(prefix + "max_over_mean_rank_load")
        name = prefix.rstrip("_").replace("layer", "L") + " " if prefix else ""
        parts.append(f"{name}cv(load) {values[prefix + 'cv_load']:.3f} max/mean load {values[key]:.2f}"
                     + (f" ({rank:.2f} per rank)" if rank is not None else ""))
    return "  " + "  ".join(parts) if parts else ""


class MeanTracker:
    """Running means of named scalars over a logging interval."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.count += 1

    def means(self) -> dict[str, float]:
        return {name: total / max(self.count, 1) for name, total in self.sums.items()}

    def reset(self) -> None:
        self.sums, self.count = {}, 0


class MoEMetrics:
    """Per MoE layer: the routed pairs and their gates (real tokens only) summed over the forwards seen since
    the last reset, their balance over every rank, and the router's own metrics averaged over the forwards;
    with `router_load` (training), the balance of the router's own load too. Keys are prefixed with
    `layer<i>_` when there are several MoE layers. The sums stay on the layers' device between log points;
    `values()` and `relative_loads()` read them, with one all-reduce: call them on every rank."""

    def __init__(self, layers, router_load: bool = False):
        self.layers, self.router_load = list(layers), router_load
        self.reset()

    def reset(self) -> None:
        self.routed: list[torch.Tensor | None] = [None] * len(self.layers)
        self.gates: list[torch.Tensor | None] = [None] * len(self.layers)
        self.load: list[torch.Tensor | None] = [None] * len(self.layers)
        self.router_sums: dict[str, torch.Tensor | float] = {}
        self.count = 0
        self._summed: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
        self._flat, self._layout = None, None   # every layer's sums in one float64 tensor; what each slice is

    def add(self) -> None:
        """Record the last forward of every layer: device additions only, all layers' vectors in one (a concatenation,
        a cast and an addition per step, whatever the number of layers: a GPU launches 3 kernels, not 6 per layer)."""
        vectors, slots = [], []
        for index, layer in enumerate(self.layers):
            stats = layer.stats
            if stats.routed_E is not None:
                vectors += [stats.routed_E, stats.routed_gates_E]
                slots += [("routed", index), ("gates", index)]
            if self.router_load:
                vectors.append(stats.load_E)
                slots.append(("load", index))
            for name, value in stats.metrics.items():
                key = self._prefix(index) + name
                value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
                self.router_sums[key] = self.router_sums.get(key, 0.0) + value
        if vectors:
            self._add_vectors(vectors, slots)
        self.count += 1
        self._summed = None

    def _add_vectors(self, vectors: list[torch.Tensor], slots: list[tuple[str, int]]) -> None:
        """Adds each vector to its slot's float64 total (self.routed / gates / load [layer]): in place into the flat
        tensor the totals are slices of, when the layers route as in the last step (always, in training)."""
        flat = torch.cat([v.detach().reshape(-1) for v in vectors]).double()
        layout = [(kind, index, v.numel()) for (kind, index), v in zip(slots, vectors)]
        if layout == self._layout:
            self._flat += flat
            return
        before = [getattr(self, kind)[index] for kind, index, _ in layout]   # the interval's first step: none
        if any(total is not None for total in before):
            flat = flat + torch.cat([flat.new_zeros(n) if total is None else total
                                     for total, (_, _, n) in zip(before, layout)])
        self._flat, self._layout = flat, layout
        for (kind, index, _), total in zip(layout, flat.split([n for _, _, n in layout])):
            getattr(self, kind)[index] = total

    def values(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for index, summed in enumerate(self._over_ranks()):
            if summed is not None:
                out.update({self._prefix(index) + name: value
                            for name, value in balance_metrics(*summed,
                                                               self.layers[index].expert_parallel_size).items()})
            if self.load[index] is not None:   # the router's load: already over the whole batch
                cv, max_over_mean = load_balance(self.load[index])
                out.update({self._prefix(index) + "cv_router_load": cv,
                            self._prefix(index) + "max_over_mean_router_load": max_over_mean})
        out.update({name: float(total) / max(self.count, 1) for name, total in self.router_sums.items()})
        return out

    def relative_loads(self) -> list[torch.Tensor]:
        """Per layer that routed since the last reset: the tokens each expert received over the mean [E] (1 =
        even), summed over every rank."""
        return [(routed / routed.mean().clamp_min(1e-12)).float().cpu()
                for _, routed in filter(None, self._over_ranks())]

    def _over_ranks(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer (None where it did not route): (summed gates, pairs) over every rank, in one all-reduce of
        all layers' vectors, kept until the next add() or reset()."""
        if self._summed is None:
            present = [i for i, routed in enumerate(self.routed) if routed is not None]
            summed: list = [None] * len(self.layers)
            if present:
                flat = torch.cat([torch.cat([self.gates[i], self.routed[i]]) for i in present])
                if dist.is_initialized() and dist.get_world_size() > 1:
                    flat = flat.to(collective_device())
                    dist.all_reduce(flat)
                for i, part in zip(present, flat.split([2 * len(self.routed[i]) for i in present])):
                    summed[i] = tuple(part.chunk(2))
            self._summed = summed
        return self._summed

    def _prefix(self, index: int) -> str:
        return "" if len(self.layers) == 1 else f"layer{index}_"

