"""Memory planner: what one GPU holds when a preset trains on a given cluster, and the smallest that fits.

Layout (moe_scale's): experts spread over expert-parallel groups of ep = min(world, experts) ranks (each
holds experts/ep of them; with fewer experts than ranks they are replicated over world/ep groups); every
other parameter (embedding, LSTMs, gating except the secondary gates below, softmax) is replicated on every rank. ZeRO partitions over the
data-parallel group: dense state over all `world` ranks, expert state over the world/ep ranks that hold
the same experts (DeepSpeed's expert-data-parallel group). Stage 1 partitions optimizer state, stage 2
also gradients; stage 3 (parameters too) is refused by DeepSpeed's MoE, so it is refused here for MoE
models.

The hierarchical MoE's secondary gating matrices (a·2·d·b) live with their groups' experts, as the paper placed
them: split over the expert-parallel ranks and partitioned like expert state (Adam's, also under `factored`).
Replicated, they were 0.25 GiB per GPU at MoE-65536-h, which put 64 K40s over 12 GiB where the paper trained on 64.

Bytes per parameter: fp32 weights and gradients (4 + 4); Adam keeps m and v (8). `factored` is App. D's
expert optimizer: β1 = 0 (no m) and a factored second moment, a row and a column vector per expert
matrix ([D, H] keeps D + H floats); dense parameters keep Adam. bf16 precision keeps 2-byte weights and
gradients and a 4-byte fp32 master copy with the optimizer state.

Activations (fp32, stored for the backward; the global batch fixed, so tokens per GPU = batch / world):
per token the embedding output d; per LSTM of h units its four gates, cell, tanh(cell) and hidden (7h)
per MoE the gate logits (one float per gating column a token evaluates), the k expert inputs and
outputs that arrive (2kd), the k expert hidden layers (k·h_e) unless recomputed, the sigmoid (d); the
softmax logits (V, or S + 1 sampled); and per layer output (embedding, LSTM, MoE) the output d and its
1-byte dropout mask. Expert-side counts assume balanced routing (each rank receives k x its own tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_scale.config import RunConfig, TrainConfig, choices
from moe_scale.errors import UserError
from moe_scale.accounting.flops import (SoftmaxCost, active_experts, lstm_layer_shape, lstm_lm_accounting, moe_gating,
                                        sharded_gating_params)
from moe_scale.accounting.presets import get_preset, preset_config

OPTIMIZERS = choices(TrainConfig, "optimizer")
PRECISIONS = ("fp32", "bf16")   # what the planner counts bytes for

GIB = 2**30
MAX_NODES = 4096


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_mem_gib: float
    zero_stage: int = 0
    optimizer: str = "adam"        # expert optimizer: "adam" or "factored"
    precision: str = "fp32"        # "fp32" or "bf16"

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def check_cluster(cluster: Cluster) -> None:
    if cluster.nodes < 1 or cluster.gpus_per_node < 1:
        raise UserError(f"--nodes {cluster.nodes} --gpus-per-node {cluster.gpus_per_node}: both must be at least 1")
    if cluster.gpu_mem_gib <= 0:
        raise UserError(f"--gpu-mem {cluster.gpu_mem_gib}: give the memory of one GPU in GiB, e.g. 80")
    if cluster.zero_stage not in (0, 1, 2, 3):
        raise UserError(f"--zero {cluster.zero_stage}: ZeRO stages are 0, 1, 2 and 3")
    if cluster.optimizer not in OPTIMIZERS or cluster.precision not in PRECISIONS:
        raise UserError("--optimizer must be adam or factored, --precision fp32 or bf16")


def expert_parallel_size(config: RunConfig, world: int) -> int:
    num_experts, groups = config.moe.experts.num_experts, config.moe.router.hierarchical.num_groups
    ep = min(world, num_experts)
    if num_experts % ep or world % ep:
        raise UserError(f"a world size of {world} GPUs does not divide the {num_experts} experts (nor do the "
                        f"experts divide it): choose a GPU count that divides {num_experts} or is a multiple of it")
    if config.moe.router.gate == "hierarchical" and groups % ep:
        raise UserError(f"a world size of {world} GPUs: the {groups} expert groups of the hierarchical MoE "
                        f"cannot be split over {ep} expert-parallel ranks (each group lives on one rank); use a "
                        f"GPU count that divides {groups}")
    return ep


def _activation_floats_per_token(config: RunConfig, vocab: int, softmax: SoftmaxCost) -> tuple[float, int]:
    """(floats, layer outputs) stored per token for the backward pass."""
    d, lstm, experts = config.model.d_model, config.model.lstm, config.moe.experts
    units, _ = lstm_layer_shape(config)
    n_lstm = {"lstm-moe-lstm": 2, "lstm-ffn-lstm": 2, "4xlstm": 4, "lstm": 1}[lstm.layout]
    outputs = 1 + n_lstm                          # embedding and LSTM outputs (each the next layer's input)
    floats = n_lstm * 7 * units
    if lstm.layout == "lstm-moe-lstm":
        k = active_experts(config)
        floats += moe_gating(config)[1] / d + 2 * k * d + d      # gate logits, expert in/out, sigmoid
        floats += 0 if experts.recompute else k * experts.hidden
        if experts.shared:   # the shared experts' hidden layer and output (and the gate's scale)
            floats += experts.shared * (experts.shared_hidden or experts.hidden) + d + int(experts.shared_gate)
        outputs += 1
    elif lstm.layout == "lstm-ffn-lstm":
        floats += lstm.ffn_layers * experts.hidden + d
        outputs += 1
    logits = vocab if softmax.kind == "full" else min(softmax.num_samples, vocab) + 1
    return floats + logits + outputs * d, outputs


def plan(preset_name: str, cluster: Cluster, batch_tokens: int | None = None) -> dict:
    check_cluster(cluster)
    preset = get_preset(preset_name)
    if preset.kind != "lstm":
        raise UserError(f"--preset {preset.name}: the planner covers the LSTM presets; MoA needs the transformer LM")
    config = preset_config(preset.name)
    vocab = config.data.vocab_size
    is_moe = config.has_moe_ffn
    if cluster.zero_stage == 3 and is_moe:
        raise UserError("--zero 3: DeepSpeed's MoE refuses ZeRO stage 3; use --zero 2 (gradients and optimizer "
                        "state partitioned)")
    world = cluster.world
    ep = expert_parallel_size(config, world) if is_moe else 1
    tokens = batch_tokens or preset.batch_words or config.train.batch_size * config.data.seq_len
    counts = lstm_lm_accounting(config, vocab, preset.softmax)
    gates_total = sharded_gating_params(config) if is_moe else 0   # secondary gates, with their experts
    expert_total = counts.params.get("experts", 0) + gates_total
    dense = counts.total_params - expert_total
    experts_here, gates_here = expert_total // ep, gates_total // ep
    expert_dp = world // ep

    weight_b, grad_b = (2, 2) if cluster.precision == "bf16" else (4, 4)
    master_b = 4 if cluster.precision == "bf16" else 0
    stage = cluster.zero_stage

    def part(n_params: float, group: int, partitioned: bool) -> float:
        return n_params / group if partitioned else n_params

    h, d = config.moe.experts.hidden, config.model.d_model
    local_experts = config.moe.experts.num_experts // ep if is_moe else 0
    if cluster.optimizer == "factored" and is_moe:
        expert_opt = local_experts * 2 * (d + h) * 4 + gates_here * 8 + experts_here * master_b
    else:
        expert_opt = experts_here * (8 + master_b)
    memory = {
        "parameters": part(dense, world, stage >= 3) * weight_b + experts_here * weight_b,
        "gradients": part(dense, world, stage >= 2) * grad_b + part(experts_here, expert_dp, stage >= 2) * grad_b,
        "optimizer_state": part(dense * (8 + master_b), world, stage >= 1) + part(expert_opt, expert_dp, stage >= 1),
    }
    floats, outputs = _activation_floats_per_token(config, vocab, preset.softmax)
    tokens_per_gpu = tokens / world
    memory["activations"] = tokens_per_gpu * (floats * 4 + outputs * d)   # + 1-byte dropout masks
    total = sum(memory.values())
    return {"preset": preset.name, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node, "world": world,
            "ep_size": ep, "experts_per_gpu": local_experts, "zero_stage": stage, "optimizer": cluster.optimizer,
            "precision": cluster.precision, "tokens_per_gpu": tokens_per_gpu,
            "params_per_gpu": dense + experts_here,
            "bytes": {**memory, "total": total}, "gpu_mem_bytes": cluster.gpu_mem_gib * GIB,
            "fits": total <= cluster.gpu_mem_gib * GIB}


def smallest_fitting(preset_name: str, cluster: Cluster, batch_tokens: int | None = None) -> dict | None:
    """The plan on the fewest nodes (same GPUs per node) that fits, or None up to MAX_NODES nodes."""
    for nodes in range(1, MAX_NODES + 1):
        shape = Cluster(nodes, cluster.gpus_per_node, cluster.gpu_mem_gib, cluster.zero_stage, cluster.optimizer,
                        cluster.precision)
        try:
            result = plan(preset_name, shape, batch_tokens)
        except UserError:
            continue      # a world size that does not divide the experts
        if result["fits"]:
            return result
    return None
