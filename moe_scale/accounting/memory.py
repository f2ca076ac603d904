"""Memory of one GPU for a layout: model state, activations, dispatch buffers and the runtime's reserves, and
whether it fits with a margin.

Model state (bytes per parameter; fp32: 4-byte weights and gradients, Adam's m and v 8; bf16: 2-byte weights and
gradients, a 4-byte fp32 master copy with the optimizer state). Dense parameters are replicated on every rank, the
expert-parallel ones split over --ep-size ranks, the vocabulary tables' rows over all ranks with --vocab-exchange
rows (else they are dense). ZeRO partitions over the data-parallel group: dense state over all ranks, expert state
over the world / ep ranks that hold the same experts (DeepSpeed's expert-data-parallel group), split rows not at all
(each lives on one rank); stage 1 partitions optimizer state, stage 2 gradients too. The factored optimizer keeps a
row and a column vector per expert matrix (accounting/model_shape.py counts them exactly); train accepts it only at
stage 0 in fp32, and so does the planner (accounting/layout.py).

Activations: the values the model stores per token for its backward outside the experts (model_shape.py), for
the tokens of one GPU's micro-batch (global batch / GPUs / --grad-accum), plus 1-byte dropout masks.

Dispatch buffers, per expert-parallel layer, at the most a rank can receive: capacity dispatch bounds it exactly
(each unit takes at most capacity_factor x its fair share from each rank, so a rank receives at most that factor
times the balanced load); dropless dispatch has no bound short of every token of the group on one rank, so it is
counted at `dropless_load` x the balanced load (default 2; `all_to_one_bytes` reports the unbounded case).
Stored for the backward per layer: the rows that arrive (d each), per active pair the expert's hidden layer (h,
unless recomputed) and output (d), a gate (4 bytes) and an index (8 bytes); MoA: the group's gathered K/V, and
per pair the query, context and attention probabilities. Transient, for one layer at a time: the send and the
returned message (d per row each) and, with recompute, the recomputed hidden layer.

Reserves (CUDA devices): the CUDA context (0.5 GiB), NCCL's buffers per communicator used (0.6 GiB each; +0.3 GiB
with NVLink SHARP on NVSwitch nodes of 3 or more GPUs), DeepSpeed's ZeRO buckets (reduce and all-gather, in the
gradient dtype, no larger than what they hold), and 5% of activations and dispatch buffers for the allocator's
fragmentation. Sources: docs/scale.md. "Fits" means the total leaves `margin` (default 5%) of the GPU free.
"""

from __future__ import annotations

from moe_scale.accounting.gpus import GPU
from moe_scale.accounting.layout import Layout
from moe_scale.accounting.model_shape import PlannedModel, sharded

GIB = 2**30
CUDA_CONTEXT_GIB = 0.5
NCCL_PER_COMMUNICATOR_GIB = 0.6
NVLS_PER_COMMUNICATOR_GIB = 0.3
FRAGMENTATION = 0.05
DEFAULT_MARGIN = 0.05
DEFAULT_DROPLESS_LOAD = 2.0
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000    # DeepSpeed's default reduce_bucket_size and allgather_bucket_size
INDEX_BYTES, GATE_BYTES = 8, 4


def model_state_bytes(model: PlannedModel, layout: Layout) -> dict[str, float]:
    """{parameters, gradients, optimizer_state} on one GPU."""
    half = layout.precision == "bf16"
    weight, grad, master = (2, 2, 4) if half else (4, 4, 0)
    stage, world, edp = layout.zero_stage, layout.world, layout.expert_data_parallel
    dense, experts = model.dense_params, model.sharded_per_rank(layout.expert_ranks, layout.etp_size)
    split = model.vocab_split(world)
    tables = model.vocab_params / world if split else model.vocab_params
    table_group = 1 if split else world   # each split row lives on one rank: nothing to partition

    def part(n: float, group: int, partitioned: bool) -> float:
        return n / group if partitioned else n

    if layout.optimizer == "factored":
        expert_state = model.factored_state / layout.expert_ranks * 4 + experts * master
    else:
        expert_state = experts * (8 + master)
    return {"parameters": (dense + experts + tables) * weight,
            "gradients": part(dense * grad, world, stage >= 2) + part(experts * grad, edp, stage >= 2)
            + part(tables * grad, table_group, stage >= 2),
            "optimizer_state": part(dense * (8 + master), world, stage >= 1) + part(expert_state, edp, stage >= 1)
            + part(tables * (8 + master), table_group, stage >= 1)}


def dispatch_load(model: PlannedModel, layout: Layout, dropless_load: float) -> float:
    """The most a rank receives, as a multiple of the balanced load (module docstring)."""
    dispatch = model.config.moe.dispatch
    if model.config.has_moe_ffn and model.config.moe.router.force_balanced_routing:
        return 1.0   # every rank receives exactly its share
    if dispatch.mode == "capacity" and model.config.has_moe_ffn:
        return min(dispatch.capacity_factor, layout.ep_size)
    if dispatch.rank_capacity_factor and model.config.has_moe_ffn:   # the budget bounds what a rank receives
        return min(dispatch.rank_capacity_factor, layout.ep_size)
    return min(dropless_load, layout.ep_size)


def dispatch_bytes(model: PlannedModel, layout: Layout, tokens_per_gpu: float, load: float) -> float:
    """Stored buffers of every expert-parallel layer plus the largest transient of one, at `load`."""
    value = 2 if layout.precision == "bf16" else 4
    d, P, T = model.config.model.d_model, layout.expert_ranks, model.config.data.seq_len
    stored = transient = 0.0
    for layer in sharded(model.expert_layers, layout.etp_size):
        rows = tokens_per_gpu * layer.distinct_ranks(P)
        pairs = load * tokens_per_gpu * layer.active * layer.shards   # --etp-size: a pair per shard, its share
        width = layer.hidden // layer.shards                           # of the hidden units
        if layer.kind == "moa":
            stored += (P * tokens_per_gpu * layer.kv_width + pairs * (2 * layer.hidden + T)) * value
        else:
            hidden = 0 if layout.recompute else width
            stored += pairs * ((hidden + d) * value + GATE_BYTES + INDEX_BYTES)
        stored += load * rows * d * value
        recomputed = pairs * width * value if layout.recompute and layer.kind == "moe" else 0
        transient = max(transient, 2 * rows * d * value + recomputed)
    return stored + transient


def communicators(layout: Layout, model: PlannedModel) -> int:
    """NCCL communicators a rank uses: data-parallel, expert-parallel, expert-data-parallel, hierarchical hops."""
    P, edp, W = layout.expert_ranks, layout.expert_data_parallel, layout.world
    count = 1 if W > 1 else 0
    if model.expert_layers and P > 1:
        count += 1 + (1 if edp > 1 else 0)
        if layout.all_to_all == "hierarchical" and model.config.has_moe_ffn:
            count += 2
    return count


def reserve_bytes(model: PlannedModel, layout: Layout, gpu: GPU, ds_config: dict, working: float) -> dict:
    if not gpu.cuda:
        return {"cuda_context": 0.0, "nccl_buffers": 0.0, "deepspeed_buckets": 0.0, "fragmentation": 0.0}
    comms = communicators(layout, model)
    nccl = comms * NCCL_PER_COMMUNICATOR_GIB
    if gpu.nvls and layout.gpus_per_node >= 3:
        nccl += comms * NVLS_PER_COMMUNICATOR_GIB
    buckets = 0.0
    if layout.zero_stage >= 1:
        zero = ds_config.get("zero_optimization", {})
        grad = 2 if layout.precision == "bf16" else 4
        local = model.params_per_gpu(layout.expert_ranks, layout.world, layout.etp_size)
        buckets = grad * (min(zero.get("reduce_bucket_size", DEEPSPEED_BUCKET_ELEMENTS), local)
                          + min(zero.get("allgather_bucket_size", DEEPSPEED_BUCKET_ELEMENTS), local))
    return {"cuda_context": CUDA_CONTEXT_GIB * GIB, "nccl_buffers": nccl * GIB, "deepspeed_buckets": buckets,
            "fragmentation": FRAGMENTATION * working}


def memory(model: PlannedModel, layout: Layout, gpu: GPU, tokens: float, ds_config: dict,
           margin: float = DEFAULT_MARGIN, dropless_load: float = DEFAULT_DROPLESS_LOAD) -> dict:
    """Bytes per GPU by part, their total, the usable memory (after the margin) and whether it fits. `tokens`: the
    global batch; activations and dispatch buffers hold one micro-batch (--grad-accum splits the batch)."""
    tokens_per_gpu = tokens / layout.world / model.config.train.grad_accum
    value = 2 if layout.precision == "bf16" else 4
    parts = model_state_bytes(model, layout)
    parts["activations"] = tokens_per_gpu * (model.activation_values_per_token * value + model.masks_per_token)
    load = dispatch_load(model, layout, dropless_load)
    parts["dispatch_buffers"] = dispatch_bytes(model, layout, tokens_per_gpu, load)
    parts.update(reserve_bytes(model, layout, gpu, ds_config, parts["activations"] + parts["dispatch_buffers"]))
    total = sum(parts.values())
    usable = gpu.memory_gib * GIB * (1 - margin)
    return {"bytes": {**parts, "total": total}, "gpu_mem_bytes": gpu.memory_gib * GIB, "usable_bytes": usable,
            "margin": margin, "dispatch_load": load,
            "all_to_one_bytes": dispatch_bytes(model, layout, tokens_per_gpu, float(layout.ep_size)),
            "fits": total <= usable}

