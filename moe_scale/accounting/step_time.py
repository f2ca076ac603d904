"""Time of one training step on a layout: compute, all-to-all, gradient synchronisation and optimizer, and what
overlaps. Balanced routing is assumed throughout (as NVIDIA's own MoE benchmarks force it).

Compute: the model's training FLOPs for one GPU's tokens (with --expert-recompute, the experts' first product
again) at `efficiency` x the GPU's dense peak for the precision, each product at the efficiency of its width
(accounting/kernels.py: narrow products are memory-bound), plus the device's fixed cost per step (none on a GPU;
measured on a CPU); but never less than the launch floor: the step's kernel launches and the LSTMs' sequential
timesteps x the GPU's cost of one launch (accounting/kernels.py counts them per layer and timestep). Waiting: every
collective waits for the slowest rank; the device's `straggler` share of the compute (none assumed on a GPU, where
routing is taken as balanced; measured on a shared CPU).

All-to-all, per expert-parallel layer and micro-batch (--grad-accum of them per step), each call costing
latency + bytes / bandwidth. A token sends one row of d values per distinct rank among the units it picked
(ExpertLayer.distinct_ranks: at most k; the rows whose destination is this rank stay here); the moves per MoE
layer: counts (one small exchange), the rows, one 8-byte index and one 4-byte gate per pair, the rows back; in the
backward the rows' gradients both ways and the gates'. MoA also moves an 8-byte position per row and all-gathers
K and V over the group (forward and backward).
  flat:          one all-to-all over the P ranks; the messages to ranks in this node go over NVLink, the rest
                 over the network at the same time (the slower bounds it);
  hierarchical:  (train's --all-to-all hierarchical) first among the W ranks of the node, then among the Q
                 ranks of the other nodes that have this one's local index: each row crosses the network once
                 and a rank talks to Q peers instead of P, paying two latencies.
Latency: the link's (inside a node, or across nodes) plus a small cost per peer.

Small synchronisations (latency-bound): every router sums its balance statistics over the data-parallel group (2
floats per unit, an all-reduce in the forward and its gradient's in the backward) per expert-parallel layer and
micro-batch, and clipping sums the squared gradient norms once per step.

Vocabulary exchange (--vocab-exchange rows, more than one GPU): the split tables' all-to-alls and gathers over all
ranks, per micro-batch (accounting/vocab_exchange.py), blocking as the experts' are.

Gradient synchronisation: dense gradients over all ranks (the vocabulary tables too where they are whole; split,
their rows need none), expert gradients over the expert-data-parallel group (world / ep). ZeRO-0 (moe_scale's
in-place reduce after the backward): all-reduce, 2 (n-1)/n of the bytes; ZeRO-1/2: reduce-scatter of the gradients
and all-gather of the updated weights, (n-1)/n each; over the network when the group spans nodes. ZeRO-2 reduces
every micro-batch's gradients, the others once per step.

Optimizer: memory-bound; bytes read and written per parameter this rank updates (Adam fp32 28 + 4 to clip, bf16
with its master copy 30 + 2, factored 20 + 4) at the device's memory bandwidth; never less than the launches made
once per step (clipping, the optimizer, the loop's bookkeeping) x the cost of one launch.

What overlaps: with ZeRO-1/2 and `"overlap_comm": true` in the DeepSpeed JSON the gradients' reduce-scatter runs
during the backward (2/3 of the compute) and only what exceeds it is paid; with --a2a-chunks C > 1 each MoE FFN
layer's row moves run in C pieces beside its experts' compute (layer_all_to_all: the hidden part is bounded by the
compute of the other pieces). Nothing else: one piece's all-to-alls are blocking (the experts need their rows), and
the stage-0 reduce runs after the backward.

TFLOPS/GPU counts the model's FLOPs (no recompute), as `train` and the paper do; MFU divides it by the peak.
"""

from __future__ import annotations

from moe_scale.accounting.gpus import GPU
from moe_scale.accounting.kernels import compute_seconds, launches
from moe_scale.accounting.layout import Layout
from moe_scale.accounting.model_shape import ExpertLayer, PlannedModel, sharded
from moe_scale.accounting.vocab_exchange import exchanges

OPTIMIZER_BYTES = {("adam", "fp32"): 32, ("adam", "bf16"): 32, ("factored", "fp32"): 24}
INDEX_BYTES, GATE_BYTES, COUNT_BYTES = 8, 4, 8


class Network:
    """The links of a cluster as the time model sees them (bytes per second per GPU and direction)."""

    def __init__(self, gpu: GPU, gpus_per_node: int, inter_gbs: float | None = None):
        self.gpu, self.per_node = gpu, gpus_per_node
        self.intra = gpu.intra_gbs * 1e9 * gpu.link_efficiency
        self.inter = (inter_gbs if inter_gbs is not None else gpu.inter_gbs) * 1e9 * gpu.link_efficiency

    def latency(self, group: int, spans_nodes: bool) -> float:
        base = self.gpu.inter_latency_s if spans_nodes else self.gpu.intra_latency_s
        return base + self.gpu.per_peer_latency_s * (group - 1)

    def all_to_all(self, nbytes: float, group: int, in_node: int) -> float:
        """One all-to-all: each rank spreads `nbytes` evenly over the `group` ranks (1/group stays), `in_node` of
        which (itself included) share its node."""
        if group <= 1:
            return 0.0
        intra = nbytes * (in_node - 1) / group
        inter = nbytes * (group - in_node) / group
        return self.latency(group, group > in_node) + max(intra / self.intra, inter / self.inter)

    def reduce(self, nbytes: float, group: int, spans_nodes: bool, traffic: float) -> float:
        """A collective over `group` ranks moving `traffic` x (n-1)/n x nbytes per rank."""
        if group <= 1 or nbytes == 0:
            return 0.0
        gpu = self.gpu
        if gpu.reduce_gbs is not None:     # measured for this very collective (tools/calibrate_plan.py)
            return gpu.reduce_latency_s + traffic * (group - 1) / group * nbytes / (gpu.reduce_gbs * 1e9)
        bandwidth = self.inter if spans_nodes else self.intra
        return self.latency(group, spans_nodes) + traffic * (group - 1) / group * nbytes / bandwidth


def _exchange(net: Network, layout: Layout, nbytes: float) -> float:
    """One row exchange over the expert-parallel group, flat or in two hops."""
    P, G = layout.expert_ranks, layout.gpus_per_node
    W = min(G, P)     # the group's ranks in one node (groups are consecutive ranks)
    if layout.all_to_all == "hierarchical":
        return net.all_to_all(nbytes, W, W) + net.all_to_all(nbytes, P // W, 1)
    return net.all_to_all(nbytes, P, W)


def layer_all_to_all(net: Network, layout: Layout, layer: ExpertLayer, tokens_per_gpu: float, d: int,
                     value: int, units_per_rank: int, chunks: int = 1, experts_s: float = 0.0) -> tuple[float, float]:
    """(exposed seconds, hidden seconds) of one expert-parallel layer's exchanges in one micro-batch (forward and
    backward). In `chunks` pieces (--a2a-chunks) the row moves overlap the layer's expert compute (`experts_s`,
    forward and backward): a pipeline of pieces takes max(A, X) + min(A, X) / C for A of moves and X of compute,
    plus a latency per move and extra piece; what exceeds X is exposed. The counts' exchange is never hidden."""
    if layout.expert_ranks == 1:
        return 0.0, 0.0
    rows = tokens_per_gpu * layer.distinct_ranks(layout.expert_ranks)   # (--etp-size: each shard's rank too)
    pairs = tokens_per_gpu * layer.picks * layer.shards
    row_bytes = rows * d * value
    counts = _exchange(net, layout, layout.expert_ranks * (units_per_rank + 1) * COUNT_BYTES)
    moves = [row_bytes, pairs * INDEX_BYTES, pairs * GATE_BYTES, row_bytes,          # forward
             row_bytes, row_bytes, pairs * GATE_BYTES]                               # backward
    seconds = sum(_exchange(net, layout, nbytes) for nbytes in moves)
    if layer.kind == "moa":
        seconds += _exchange(net, layout, rows * INDEX_BYTES)
        kv = layout.ep_size * tokens_per_gpu * layer.kv_width * value    # P copies of this rank's K/V
        seconds += 2 * net.all_to_all(kv, layout.ep_size, min(layout.gpus_per_node, layout.ep_size))
    if chunks == 1 or layer.kind == "moa":
        return counts + seconds, 0.0
    pieces = seconds + (chunks - 1) * len(moves) * _exchange(net, layout, 0.0)
    exposed = max(pieces, experts_s) + min(pieces, experts_s) / chunks - experts_s
    return counts + exposed, max(0.0, seconds - exposed)


def gradient_sync(net: Network, model: PlannedModel, layout: Layout) -> tuple[float, float]:
    """(seconds of the reduce-scatter or all-reduce, seconds of the ZeRO all-gather of weights)."""
    grad = weight = 2 if layout.precision == "bf16" else 4
    world, edp, G = layout.world, layout.expert_data_parallel, layout.gpus_per_node
    experts = model.sharded_per_rank(layout.expert_ranks, layout.etp_size)
    # split tables: each row lives on one rank, which has every rank's contribution to it: nothing to reduce
    groups = [(model.dense_params + (0 if model.vocab_split(world) else model.vocab_params), world, world > G)]
    if experts and edp > 1:
        groups.append((experts, edp, world > G))
    reduce = gather = 0.0
    for n, group, spans in groups:
        if layout.zero_stage == 0:
            reduce += net.reduce(n * grad, group, spans, 2)
        else:
            reduce += net.reduce(n * grad, group, spans, 1)
            gather += net.reduce(n * weight, group, spans, 1)
    return reduce, gather


def small_syncs(net: Network, model: PlannedModel, layout: Layout) -> float:
    """The routers' statistics (forward and backward, every micro-batch), the gradients of what --etp-size copies
    summed over each expert's shards (every micro-batch's backward) and the gradient norm (once)."""
    world, spans = layout.world, layout.world > layout.gpus_per_node
    if world == 1:
        return 0.0
    routers = sum(2 * net.reduce(2 * layer.units * 4, world, spans, 2) for layer in model.expert_layers)
    T = layout.etp_size
    if T > 1 and model.copied_params:
        grad = 2 if layout.precision == "bf16" else 4
        routers += net.reduce(model.copied_params / layout.ep_size * grad, T, T > layout.gpus_per_node, 2)
    return model.config.train.grad_accum * routers + net.reduce(2 * 8, world, spans, 2)


def optimizer_seconds(model: PlannedModel, layout: Layout, gpu: GPU) -> float:
    partitioned = layout.zero_stage >= 1
    split = model.vocab_split(layout.world)
    dense = (model.dense_params + (0 if split else model.vocab_params)) / (layout.world if partitioned else 1)
    experts = model.sharded_per_rank(layout.expert_ranks, layout.etp_size) / \
        (layout.expert_data_parallel if partitioned else 1)
    tables = model.vocab_params / layout.world if split else 0.0
    adam = OPTIMIZER_BYTES[("adam", layout.precision)]
    expert_bytes = OPTIMIZER_BYTES[("factored", "fp32")] if layout.optimizer == "factored" else adam
    return ((dense + tables) * adam + experts * expert_bytes) / (gpu.hbm_gbs * 1e9 * gpu.hbm_efficiency)


def vocab_exchange_seconds(net: Network, model: PlannedModel, layout: Layout, tokens_per_gpu: float,
                           value: int) -> float:
    """Seconds of the split vocabulary tables' exchanges in one micro-batch (accounting/vocab_exchange.py)."""
    P = layout.world
    in_node, spans = min(layout.gpus_per_node, P), P > layout.gpus_per_node
    seconds = 0.0
    for kind, nbytes in exchanges(model.config, model.vocab, P, tokens_per_gpu, value):
        if kind == "all_to_all":
            seconds += net.all_to_all(nbytes, P, in_node)
        else:
            seconds += net.reduce(nbytes, P, spans, 1 if kind == "all_gather" else 2)
    return seconds


def step_time(model: PlannedModel, layout: Layout, gpu: GPU, tokens: float, ds_config: dict,
              inter_gbs: float | None = None, efficiency: float | None = None) -> dict:
    """The predicted step: its parts in seconds, tokens/s, TFLOPS/GPU and MFU."""
    net = Network(gpu, layout.gpus_per_node, inter_gbs)
    tokens_per_gpu = tokens / layout.world
    value = 2 if layout.precision == "bf16" else 4
    peak = gpu.peak_tflops(layout.precision)
    efficiency = gpu.efficiency if efficiency is None else efficiency
    products = compute_seconds(model, layout, gpu, tokens_per_gpu, efficiency)
    flops_s = products["seconds"] + gpu.step_overhead_s
    kernels = launches(model, layout)
    launch_floor = (kernels["operations"] + kernels["recurrence"]) * gpu.launch_s
    compute = max(flops_s, launch_floor)
    d, accum = model.config.model.d_model, model.config.train.grad_accum
    chunks = model.config.moe.dispatch.a2a_chunks if model.config.has_moe_ffn else 1
    ffn_layers = sum(layer.kind != "moa" for layer in model.expert_layers)
    experts_s = products["by_part"].get("experts", 0.0) / max(ffn_layers, 1) / accum   # a layer's, a micro-batch's
    exchanges = [layer_all_to_all(net, layout, layer, tokens_per_gpu / accum, d, value,
                                  layer.units * layer.shards // layout.expert_ranks, chunks, experts_s)
                 for layer in sharded(model.expert_layers, layout.etp_size)]
    all_to_all = accum * sum(exposed for exposed, _ in exchanges)
    all_to_all_hidden = accum * sum(hidden for _, hidden in exchanges)
    vocab = accum * vocab_exchange_seconds(net, model, layout, tokens_per_gpu / accum, value)
    reduce, gather = gradient_sync(net, model, layout)
    if layout.zero_stage == 2:
        reduce *= accum     # ZeRO-2 reduces (scatters) the gradients of every micro-batch
    overlap = layout.zero_stage >= 1 and ds_config.get("zero_optimization", {}).get("overlap_comm", False)
    exposed = (max(0.0, reduce - compute * 2 / 3) if overlap else reduce) + gather
    optimizer_bytes_s = optimizer_seconds(model, layout, gpu)
    optimizer = max(optimizer_bytes_s, kernels["per_step"] * gpu.launch_s)
    sync = small_syncs(net, model, layout)
    waiting = gpu.straggler * compute if layout.world > 1 else 0.0
    step = compute + waiting + all_to_all + vocab + sync + exposed + optimizer
    tflops = model.flops_per_token * tokens_per_gpu / step / 1e12
    return {"seconds": {"compute": compute, "waiting": waiting, "all_to_all": all_to_all, "vocab_exchange": vocab,
                        "sync": sync, "gradient_sync": exposed,
                        "optimizer": optimizer, "step": step},
            "gradient_sync_total_s": reduce + gather, "gradient_sync_overlapped": bool(overlap),
            "flops_s": flops_s, "launch_floor_s": launch_floor, "optimizer_bytes_s": optimizer_bytes_s,
            "launches": {**kernels, "launch_s": gpu.launch_s},
            "compute_bound": "launches" if launch_floor > flops_s else "flops",
            "gemm_efficiency": products["efficiency"], "gemm_full_width": products["full_width"],
            "narrow_products": products["narrow"],
            "efficiency": efficiency, "peak_tflops": peak, "tokens_per_s": tokens / step,
            "tflops_per_gpu": tflops, "mfu": tflops / peak, "all_to_all_share": all_to_all / step,
            "a2a_chunks": chunks, "all_to_all_hidden_s": all_to_all_hidden,
            "all_to_all_hidden_share": all_to_all_hidden / (all_to_all + all_to_all_hidden)
            if all_to_all + all_to_all_hidden else 0.0}
