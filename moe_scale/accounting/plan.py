"""The planner: one model (any config `train` can build) on a cluster of one GPU type, one layout at a time.

`Planner.plan(layout)` checks the layout with `train`'s own checks (accounting/layout.py), then predicts the
memory of one GPU (accounting/memory.py) and the time of one step (accounting/step_time.py), with a warning line
where the time rests on the launch floor or on narrow products (accounting/kernels.py). `smallest_fitting` walks
the node counts up from 1 until a layout fits. The default expert-parallel size on W GPUs (when --ep-size is not
given, --config's run's included) is the largest that divides W and every expert-parallel layer's units (experts;
the hierarchical gate's groups; MoA's attention experts): experts spread as far as the cluster allows.

`training(result, tokens)`: what `tokens` training tokens take at the predicted rate: wall time = tokens /
(tokens/s), GPU-hours = wall time x GPUs / 3600, steps = tokens / tokens per step, rounded up.

`fewer_nodes_remark(...)`: where more nodes predict fewer tokens/s than fewer nodes (the same global batch spread
thinner: each GPU's compute shrinks, the exchanges and all-reduces do not, and more of them cross the network), the
exchanges' share of the step, and the global batch at which the compute's share has grown enough for the more
nodes to predict more tokens/s than the fewer at that batch (the smallest power-of-two multiple of the batch, up
to 65,536x; or that none does: the exchanges grow with the batch as fast as the compute).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moe_scale.accounting.gpus import GPU
from moe_scale.accounting.layout import Layout, batch_sequences, checked_config, ds_config_for
from moe_scale.accounting.memory import DEFAULT_DROPLESS_LOAD, DEFAULT_MARGIN, memory
from moe_scale.accounting.model_shape import PlannedModel
from moe_scale.accounting.step_time import step_time
from moe_scale.accounting.units import seconds_text
from moe_scale.errors import UserError

MAX_NODES = 4096
MAX_BATCH_GROWTH = 2 ** 16
# The small-product curve is worth a warning where it slows the FLOPs by more than this share (and the optimizer's
# launch floor where it is this share of the step).
NARROW_WARNING = 0.1
# The parts of a step that are not compute, and their names in a remark.
EXCHANGE_PARTS = {"all_to_all": "all-to-all", "vocab_exchange": "vocabulary rows", "sync": "router and norm sums",
                  "gradient_sync": "gradient sync", "waiting": "waiting"}


@dataclass(frozen=True)
class Planner:
    model: PlannedModel
    gpu: GPU
    base_ds: dict                        # the user's DeepSpeed JSON (or the built-in one)
    batch_tokens: int | None = None      # None: the config's --batch-size x --seq-len
    inter_gbs: float | None = None       # None: the GPU type's default
    efficiency: float | None = None      # None: the GPU type's
    margin: float = DEFAULT_MARGIN
    dropless_load: float = DEFAULT_DROPLESS_LOAD
    name: str = "custom"

    def default_ep(self, world: int) -> int:
        """The largest expert-parallel size dividing the GPUs and every expert-parallel layer's units."""
        return math.gcd(world, *self.model.sharded_units) if self.model.expert_layers else 1

    def plan(self, layout: Layout) -> dict:
        """The layout's memory and step time; UserError if `train` would refuse it."""
        config = checked_config(self.model.config, self.base_ds, layout, self.batch_tokens)
        tokens = config.train.batch_size * config.data.seq_len
        ds = ds_config_for(self.base_ds, layout)
        mem = memory(self.model, layout, self.gpu, tokens, ds, self.margin, self.dropless_load)
        time = step_time(self.model, layout, self.gpu, tokens, ds, self.inter_gbs, self.efficiency)
        experts = config.moe.experts.num_experts if config.has_moe_ffn else 0
        return {"preset": self.name, "gpu": self.gpu.name, "nodes": layout.nodes,
                "gpus_per_node": layout.gpus_per_node, "world": layout.world, "ep_size": layout.ep_size,
                "experts_per_gpu": experts // layout.ep_size, "zero_stage": layout.zero_stage,
                "optimizer": layout.optimizer, "precision": layout.precision, "recompute": layout.recompute,
                "all_to_all": layout.all_to_all,
                "force_balanced_routing": bool(config.has_moe_ffn and config.moe.router.force_balanced_routing),
                "batch_sequences": config.train.batch_size,
                "tokens_per_step": tokens, "tokens_per_gpu": tokens / layout.world,
                "params_total": self.model.total_params,
                "params_per_gpu": round(self.model.params_per_gpu(layout.expert_ranks, layout.world, layout.etp_size)),
                "etp_size": layout.etp_size,
                "flops_per_token": self.model.flops_per_token, **mem, "time": time,
                "tokens_per_s": time["tokens_per_s"], "tflops_per_gpu": time["tflops_per_gpu"], "mfu": time["mfu"],
                "warnings": time_warnings(time)}

    def with_nodes(self, layout: Layout, nodes: int, ep_fixed: bool) -> Layout:
        world = nodes * layout.gpus_per_node
        return dataclasses.replace(layout, nodes=nodes, ep_size=layout.ep_size if ep_fixed else self.default_ep(world))

    def smallest_fitting(self, layout: Layout, ep_fixed: bool, max_nodes: int = MAX_NODES) -> dict | None:
        """The plan on the fewest nodes (the layout otherwise as given) that `train` accepts and that fits."""
        for nodes in range(1, max_nodes + 1):
            candidate = self.with_nodes(layout, nodes, ep_fixed)
            if not self.fits(candidate):
                continue        # cheap: memory alone, before train's checks
            try:
                result = self.plan(candidate)
            except UserError:
                continue        # e.g. a GPU count that --ep-size or the batch does not divide
            if result["fits"]:
                return result
        return None

    def fits(self, layout: Layout) -> bool:
        """Whether the layout's memory fits (no checks: `plan` makes them)."""
        if layout.world % layout.expert_ranks:
            return False
        tokens = batch_sequences(self.model.config, layout, self.batch_tokens) * self.model.config.data.seq_len
        return memory(self.model, layout, self.gpu, tokens, ds_config_for(self.base_ds, layout), self.margin,
                      self.dropless_load)["fits"]


def time_warnings(time: dict) -> list[str]:
    """One line where the predicted compute is the launch floor, or else where narrow products slow its FLOPs by
    more than NARROW_WARNING (accounting/kernels.py); one where the optimizer part is its launch floor and at least
    NARROW_WARNING of the step."""
    lines = []
    launches, s = time["launches"], time["seconds"]
    if time["compute_bound"] == "launches":
        recurrence = f" and {launches['recurrence']:,} sequential LSTM timesteps" if launches["recurrence"] else ""
        lines.append(f"the compute is the launch floor, not the FLOPs: {launches['operations']:,} kernel launches"
                     f"{recurrence} a step x {seconds_text(launches['launch_s'])} = "
                     f"{seconds_text(time['launch_floor_s'])}, against {seconds_text(time['flops_s'])} of FLOPs "
                     f"(a larger batch per GPU costs no more time until its FLOPs pass the floor)")
    elif time["gemm_efficiency"] < (1 - NARROW_WARNING) * time["efficiency"]:
        narrow = ", ".join(f"{part} {width:,.0f}" for part, width in sorted(time["narrow_products"].items(),
                                                                            key=lambda item: item[1]))
        lines.append(f"the FLOPs run at {time['gemm_efficiency']:.1%} of the peak, not {time['efficiency']:.0%}: "
                     f"products whose smallest dimension is under {time['gemm_full_width']:.0f} are memory-bound "
                     f"(here {narrow}; the small-product curve)")
    optimizer_floor = s["optimizer"] > time["optimizer_bytes_s"]
    if optimizer_floor and time["compute_bound"] == "launches":
        lines[-1] += (f"; the optimizer part is its floor too ({launches['per_step']} launches a step for clipping, "
                      f"the optimizer and the loop)")
    elif optimizer_floor and s["optimizer"] >= NARROW_WARNING * s["step"]:
        lines.append(f"the optimizer part is the launch floor, not its memory traffic: {launches['per_step']} "
                     f"launches a step (clipping, the optimizer, the loop) x {seconds_text(launches['launch_s'])} = "
                     f"{seconds_text(s['optimizer'])}, against {seconds_text(time['optimizer_bytes_s'])}")
    return lines


def training(result: dict, tokens: int) -> dict:
    """What `tokens` training tokens take at the plan's tokens/s (module docstring)."""
    wall = tokens / result["tokens_per_s"]
    return {"tokens": tokens, "steps": math.ceil(tokens / result["tokens_per_step"]), "wall_s": wall,
            "gpu_hours": wall * result["world"] / 3600}


def _compute_share(result: dict) -> float:
    s = result["time"]["seconds"]
    return s["compute"] / s["step"]


def _exchange_share(result: dict) -> float:
    s = result["time"]["seconds"]
    return sum(s[part] for part in EXCHANGE_PARTS) / s["step"]


def _exchange_parts(result: dict, top: int = len(EXCHANGE_PARTS)) -> str:
    """The exchanges' shares of the step, largest first ("vocabulary rows 24%, all-to-all 16%")."""
    s = result["time"]["seconds"]
    shares = sorted(((s[part] / s["step"], name) for part, name in EXCHANGE_PARTS.items()), reverse=True)
    return ", ".join(f"{name} {share:.0%}" for share, name in shares[:top] if share >= 0.01)


def fewer_nodes_remark(planner: Planner, layout: Layout, result: dict, fewer: dict,
                       fewer_layout: Layout) -> dict | None:
    """None unless `result` (on `layout`) predicts fewer tokens/s than `fewer` (on `fewer_layout`, fewer nodes);
    else {"text": one line naming the cause and the hint, "slowdown", "exchange_share", "compute_share",
    "fewer_nodes", "fewer_compute_share", "batch_growth", "batch_tokens"} (module docstring)."""
    if result["nodes"] <= fewer["nodes"] or result["tokens_per_s"] >= fewer["tokens_per_s"]:
        return None
    slowdown = fewer["tokens_per_s"] / result["tokens_per_s"]
    growth = batch = bigger = None
    factor = 2
    while factor <= MAX_BATCH_GROWTH:
        grown = dataclasses.replace(planner, batch_tokens=result["tokens_per_step"] * factor)
        try:
            bigger, smaller = grown.plan(layout), grown.plan(fewer_layout)
        except UserError:
            factor *= 2
            continue
        if bigger["tokens_per_s"] > smaller["tokens_per_s"]:
            growth, batch = factor, bigger["tokens_per_step"]
            break
        factor *= 2
    plural = "node" if fewer["nodes"] == 1 else "nodes"
    if growth is not None:
        fits = "fits" if bigger["fits"] else "does NOT fit: add --grad-accum"
        hint = (f"grow the global batch {growth:,}x (--batch-tokens {batch:,}): the compute is then "
                f"{_compute_share(bigger):.0%} of the step and {result['nodes']} nodes predict "
                f"{bigger['tokens_per_s']:,.0f} tokens/s against {smaller['tokens_per_s']:,.0f} on {fewer['nodes']} "
                f"{plural} ({bigger['bytes']['total'] / 2 ** 30:.2f} GiB per GPU, {fits})")
    else:
        grows = "" if bigger is None else (f" (at {factor // 2:,}x the batch: {_exchange_parts(bigger, 2)} of "
                                           f"the step)")
        hint = (f"at no batch up to {MAX_BATCH_GROWTH:,}x this one do {result['nodes']} nodes beat {fewer['nodes']}"
                f": the exchanges grow with the batch as fast as the compute{grows}; plan {fewer['nodes']} {plural}")
    text = (f"{result['nodes']} nodes predict {slowdown:.3g}x fewer tokens/s than {fewer['nodes']} {plural} "
            f"({result['tokens_per_s']:,.0f} against {fewer['tokens_per_s']:,.0f}): at this batch "
            f"({result['tokens_per_step']:,} tokens, {result['tokens_per_gpu']:,.0f} per GPU) the exchanges and "
            f"all-reduces take {_exchange_share(result):.0%} of the step ({_exchange_parts(result)}) and the compute "
            f"{_compute_share(result):.0%}, against {_compute_share(fewer):.0%} on {fewer['nodes']} {plural}; {hint}")
    return {"text": text, "slowdown": slowdown, "exchange_share": _exchange_share(result),
            "compute_share": _compute_share(result), "fewer_nodes": fewer["nodes"],
            "fewer_compute_share": _compute_share(fewer), "batch_growth": growth, "batch_tokens": batch}
