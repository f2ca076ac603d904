"""Kernels of a training step: the floor their launches put under it, and the efficiency of narrow matrix products.

Launch floor. A step is kernels the host launches one after another (eager PyTorch, DeepSpeed): however few FLOPs
they do, each launch takes `GPU.launch_s` (5 µs; accounting/gpus.py gives the sources), so a step of n launches
takes at least n x launch_s. The launches come from a model of the step: the operations that launch a kernel, per
part of the model, as tools/count_step_syncs.py counted them (`moe-scale train`'s step 5 of 6 on CPU with CUDA's
kernel choices; d = 64, expert hidden 128, 8 sequences of 32 tokens, 1 rank, ds_configs/gpu_bf16_zero2.json; an
nn.LSTM counted as cuDNN's one kernel each way). Forward + backward, per micro-batch:

    LSTM LM           embedding, dropout, softmax and loss                        30   (8 forward, 22 backward)
                      each LSTM                                                   16   (4, 12)
                      the MoE layer (gate, dispatch, experts, combine, sigmoid)  133   (52, 81)
                      the dense FFN (lstm-ffn-lstm)                               16   (5, 11), + 7 per further
                                                                                       --ffn-layers (2, 5)
    transformer       embedding, final norm, softmax and loss                     36   (8, 28)
                      each block with a dense FFN                                 65   (14, 51)
                      each block with an MoE FFN                                 174   (60, 114)
    expert parallel   each expert-parallel layer whose experts span ranks         35   (33, 2: its exchange)
    vocabulary        the split tables' exchanges, on more than one rank          81

and once per step (clipping, the optimizer, the loop's bookkeeping): 44 without expert parameters (28, 6, 10), 63
with them (39, 11, 13), 3 more on several ranks. The counts depend on the layers, not on the widths or the number
of experts (64 or 16 experts: 258 and 262 in all); other gates, expert kinds, MoA and the llama block are counted
as the default's; ZeRO-0 in fp32 launches about as many (249 against 258 for the LSTM-MoE model: fewer in the
backward, more per-parameter norms in the clipping). The expert-parallel and vocabulary counts are the 2-rank
step's additions (docs/gpu.md).

Recurrence. cuDNN runs an LSTM's input products for all timesteps at once, then, timestep after timestep, one
product with the recurrent weights and one fused element-wise kernel; its backward the same in reverse, the weight
gradients again for all timesteps at once (Appleyard, Kocisky and Blunsom 2016, arXiv:1604.01946: cuDNN 5's
optimisations). A projection (--lstm-hidden wider than --d-model) adds a product per timestep each way. Torch takes
cuDNN's persistent kernel instead for up to 192 units forward and 128 backward without a projection
(aten/src/ATen/native/cudnn/RNN.cpp, get_algo: CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H): one launch, but the
timesteps still run one after another, a grid-wide barrier between two, counted here as one launch's time (no
published figure for that barrier: an assumption). Per LSTM, timestep and micro-batch, forward + backward: 4
(6 with a projection; 2 with both directions persistent, 3 with the forward only).

    compute >= (operations + recurrent timesteps) x micro-batches x launch_s
    optimizer part >= the per-step launches x launch_s

Small products. A product whose smallest dimension s (rows, or either width) is narrow cannot keep the tensor
cores busy: it moves at least its largest matrix (a x b values of `value` bytes, a and b its two larger
dimensions) for 2·s·a·b FLOPs, so below the GPU's ridge point it is bound by the memory:

    efficiency(s) = efficiency x min(1, s / s_full),   s_full = efficiency x value x peak / (2 x hbm x 0.8)

(saturating at the GPU's stated efficiency; below s_full the product's time is its bytes at 80% of the memory
bandwidth). s_full is 129 on an H100 SXM in bf16 (and in TF32 fp32), 67 on an A100-80, 22 on a K40. The rows of a
product: a micro-batch's tokens on one GPU; its sequences for the LSTM's per-timestep products; for the experts,
the rows one expert receives (tokens x ep x active experts / experts, balanced). The widths: LSTM input d -> 4u,
recurrent r -> 4u (r = u, or the projection p), projection u -> p; attention d -> heads x head width (MoA: top-k x
head width) and the window T; the gate d -> experts (the hierarchical gate: d -> groups, then its chosen groups'
secondary gates d -> experts per group, on the micro-batch's tokens); experts and dense FFNs d -> hidden; the
softmax d -> its classes (its MACs per token / d).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_scale.accounting.gpus import GPU

# Kernel-launching operations per micro-batch, forward + backward (module docstring).
LSTM_LM_BASE, PER_LSTM, LSTM_MOE_LAYER, LSTM_FFN, PER_FFN_LAYER = 30, 16, 133, 16, 7
TRANSFORMER_BASE, DENSE_BLOCK, MOE_BLOCK = 36, 65, 174
EXPERT_EXCHANGE, VOCAB_EXCHANGE = 35, 81
# Once per step: clipping, optimizer and the loop (without and with expert parameters), and what several ranks add.
PER_STEP_DENSE, PER_STEP_EXPERTS, PER_STEP_RANKS = 44, 63, 3
# cuDNN per LSTM and timestep, each direction: the recurrent product and the element-wise kernel; + a projection's.
STANDARD_STEP_KERNELS, PROJECTION_STEP_KERNELS = 2, 1
# Torch's persistent small-hidden LSTM kernel: up to these units, forward and backward (no projection).
PERSISTENT_FORWARD_UNITS, PERSISTENT_BACKWARD_UNITS = 192, 128
HBM_SHARE = 0.8          # a memory-bound product streams at this share of the bandwidth (the optimizer's too)


@dataclass(frozen=True)
class Gemms:
    """One part of the model's matrix products: their forward MACs per token, the widths among their dimensions,
    and what their rows are: "tokens" (a micro-batch's tokens on one GPU), "sequences" (its sequences: the LSTM's
    per-timestep products) or "expert" (the rows one expert receives)."""

    part: str
    macs: float
    widths: tuple[int, ...]
    rows: str = "tokens"


def lstm_count(config) -> int:
    return {"lstm-moe-lstm": 2, "lstm-ffn-lstm": 2, "4xlstm": 4, "lstm": 1}[config.model.lstm.layout]


def gemm_groups(config, macs: dict[str, float]) -> tuple[Gemms, ...]:
    """The model's forward MACs per token (`macs`, by part, as the planner counts them) as groups of products of
    one shape each; their MACs add up to all of `macs`."""
    from moe_scale.accounting.flops import ffn_macs, lstm_layer_shape

    d = config.model.d_model
    groups: list[Gemms] = []
    if config.model.kind == "transformer":
        attention, blocks = config.attention, config.model.transformer
        heads = attention.moa.top_k if attention.kind == "moa" else attention.num_heads
        groups.append(Gemms("attention", macs["attention"], (d, heads * attention.head_width(d),
                                                              config.data.seq_len)))
        if blocks.ffn == "dense":
            groups.append(Gemms("ffn", macs["ffn"], (d, blocks.ffn_hidden)))
        else:
            groups += _moe_groups(config, blocks.num_layers)
    else:
        n, (units, proj) = lstm_count(config), lstm_layer_shape(config)
        recurrent = proj or units
        groups += [Gemms("lstm input", n * 4 * units * d, (d, 4 * units)),
                   Gemms("lstm recurrent", n * 4 * units * recurrent, (recurrent, 4 * units), "sequences")]
        if proj:
            groups.append(Gemms("lstm projection", n * units * proj, (units, proj), "sequences"))
        if config.model.lstm.layout == "lstm-moe-lstm":
            groups += _moe_groups(config, 1)
        elif config.model.lstm.layout == "lstm-ffn-lstm":
            hidden = config.moe.experts.hidden
            groups.append(Gemms("ffn", ffn_macs(d, hidden, config.model.lstm.ffn_layers), (d, hidden)))
    softmax = macs["softmax"]
    groups.append(Gemms("softmax", softmax, (d, max(1, round(softmax / d)))))
    rest = sum(macs.values()) - sum(g.macs for g in groups)
    if abs(rest) > 1e-6 * max(1.0, sum(macs.values())):
        groups.append(Gemms("other", rest, (d,)))
    return tuple(g for g in groups if g.macs)


def _moe_groups(config, layers: int) -> list[Gemms]:
    from moe_scale.accounting.flops import active_experts, expert_macs, moe_gating, shared_experts
    from moe_scale.moe.router.build import gate_class

    d, router, experts = config.model.d_model, config.moe.router, config.moe.experts
    units = gate_class(router).dispatch_units(router, experts.num_experts)
    gate = moe_gating(config)[1]
    if units == experts.num_experts:
        groups = [Gemms("gate", layers * gate, (d, units))]
    else:   # the hierarchical gate: the primary d -> groups, the chosen groups' secondary d -> experts per group
        primary = 2 * d * units
        groups = [Gemms("gate", layers * primary, (d, units)),
                  Gemms("secondary gates", layers * (gate - primary), (d, experts.num_experts // units))]
    groups.append(Gemms("experts", layers * active_experts(config) * expert_macs(config, experts.hidden),
                        (d, experts.hidden), "expert"))
    if experts.shared:
        groups.append(Gemms("shared experts", layers * shared_experts(config),
                            (d, experts.shared_hidden or experts.hidden)))
    return groups


def saturation_width(gpu: GPU, precision: str, efficiency: float) -> float:
    """s_full: the smallest dimension from which a product runs at `efficiency` of the peak (module docstring);
    0 where the device has no small-product curve."""
    if not gpu.small_gemm:
        return 0.0
    value = 2 if precision == "bf16" else 4
    return efficiency * value * gpu.peak_tflops(precision) * 1e12 / (2 * gpu.hbm_gbs * 1e9 * HBM_SHARE)


def gemm_efficiency(width: float, efficiency: float, full_width: float) -> float:
    """The share of the peak a product whose smallest dimension is `width` runs at."""
    if full_width <= 0:
        return efficiency
    return efficiency * min(1.0, width / full_width)


def product_rows(model, layout, tokens_per_micro_batch: float) -> dict[str, float]:
    """Rows of each kind of product (Gemms.rows) in one micro-batch on one GPU."""
    config = model.config
    rows = {"tokens": tokens_per_micro_batch, "sequences": tokens_per_micro_batch / config.data.seq_len}
    if config.has_moe_ffn:
        from moe_scale.accounting.flops import active_experts

        rows["expert"] = (tokens_per_micro_batch * layout.expert_ranks * active_experts(config)
                          / config.moe.experts.num_experts)
    return rows


def compute_seconds(model, layout, gpu: GPU, tokens_per_gpu: float, efficiency: float) -> dict:
    """The FLOPs' time on one GPU with each product at its width's efficiency: {"seconds", "efficiency" (the
    FLOPs' average share of the peak), "full_width" (s_full), "narrow": the parts below it, by width, "by_part":
    the seconds of each part (the experts' are what an overlapped exchange hides behind)}."""
    config, peak = model.config, gpu.peak_tflops(layout.precision) * 1e12
    full = saturation_width(gpu, layout.precision, efficiency)
    rows = product_rows(model, layout, tokens_per_gpu / config.train.grad_accum)
    seconds, flops, narrow, by_part = 0.0, 0.0, {}, {}
    recompute = model.recompute_flops_per_token if layout.recompute else 0.0
    for group in model.gemms:
        widths = group.widths if group.part != "experts" else (group.widths[0], group.widths[1] / layout.etp_size)
        width = min(rows[group.rows], *widths)   # (--etp-size: an expert shard's hidden units)
        share = gemm_efficiency(width, efficiency, full)
        part_flops = tokens_per_gpu * (6 * group.macs + (recompute if group.part == "experts" else 0.0))
        seconds += part_flops / (peak * share)
        by_part[group.part] = by_part.get(group.part, 0.0) + part_flops / (peak * share)
        flops += part_flops
        if share < efficiency:
            narrow[group.part] = width
    return {"seconds": seconds, "efficiency": flops / (seconds * peak) if seconds else efficiency,
            "full_width": full, "narrow": narrow, "by_part": by_part}


def recurrent_steps_per_timestep(config) -> int:
    """Sequential kernels (or barriers) per LSTM and timestep, forward + backward (module docstring)."""
    from moe_scale.accounting.flops import lstm_layer_shape

    units, proj = lstm_layer_shape(config)
    if proj:
        return 2 * (STANDARD_STEP_KERNELS + PROJECTION_STEP_KERNELS)
    forward = 1 if units <= PERSISTENT_FORWARD_UNITS else STANDARD_STEP_KERNELS
    backward = 1 if units <= PERSISTENT_BACKWARD_UNITS else STANDARD_STEP_KERNELS
    return forward + backward


def launches(model, layout) -> dict:
    """Kernel launches of one step on one GPU (module docstring): {"operations": the model's kernel-launching
    operations, "recurrence": the LSTMs' sequential timesteps (both over all micro-batches), "per_step": clipping,
    optimizer and loop}."""
    config = model.config
    if config.model.kind == "transformer":
        blocks = config.model.transformer
        operations = TRANSFORMER_BASE + blocks.num_layers * (MOE_BLOCK if blocks.ffn == "moe" else DENSE_BLOCK)
        recurrence = 0
    else:
        n, layout_kind = lstm_count(config), config.model.lstm.layout
        operations = LSTM_LM_BASE + n * PER_LSTM
        if layout_kind == "lstm-moe-lstm":
            operations += LSTM_MOE_LAYER
        elif layout_kind == "lstm-ffn-lstm":
            operations += LSTM_FFN + PER_FFN_LAYER * (config.model.lstm.ffn_layers - 1)
        recurrence = n * config.data.seq_len * recurrent_steps_per_timestep(config)
    if layout.expert_ranks > 1:
        operations += EXPERT_EXCHANGE * len(model.expert_layers)
    if model.vocab_split(layout.world):
        operations += VOCAB_EXCHANGE
    accum = config.train.grad_accum
    per_step = (PER_STEP_EXPERTS if model.sharded_params else PER_STEP_DENSE) \
        + (PER_STEP_RANKS if layout.world > 1 else 0)
    return {"operations": operations * accum, "recurrence": recurrence * accum, "per_step": per_step}
