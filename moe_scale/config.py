"""Typed run configuration: a tree of per-component dataclasses, one flag per leaf, saved with every run.

    RunConfig
      model       ModelConfig        kind (lstm | transformer), width, dropout; lstm: LSTMConfig, transformer: ...
      moe         MoEConfig          router: RouterConfig (one sub-config per gate), dispatch: DispatchConfig,
                                     experts: ExpertsConfig
      attention   AttentionConfig    kind (mha | moa | mae), heads; moa: MoAConfig, mae: MAEConfig
      softmax     SoftmaxConfig      full | sampled | adaptive
      data        DataConfig         text, vocabulary, windows, streaming
      train       TrainConfig        batch, steps, optimizer, schedule, seed
      parallel    ParallelConfig     expert parallelism, the DeepSpeed JSON
      run         RunDirConfig       run directory, resume, intervals

Every leaf has a key, its field name unless it says otherwise (`gate` for moe.router.gate), which is its flag
(`--gate`) and its name in a preset; keys are unique over the tree. `moe-scale train --help` is generated from
this tree, so a flag and the saved `config.json` never drift apart. Each component validates its own fields
(`validate()`); `RunConfig.validate()` adds the checks that span components. A `config.json` written before
the tree existed (sections model, data, train, flat) is read by key and migrated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from moe_scale.errors import UserError
from moe_scale.run_files import RunFiles

FORMAT = 2   # config.json's "format": 2 is this tree; files without it are the flat layout of format 1


@dataclass(frozen=True)
class Needs:
    """What a setting (or every setting of a section) needs to take effect: `applies(config)`, else the flags
    that would make it apply. `alone`: the needs of the enclosing sections do not hold for it."""

    applies: Callable[["RunConfig"], bool]
    flags: str
    alone: bool = False


def _f(default, help: str, choices: tuple | None = None, key: str | None = None, needs: Needs | None = None):
    return field(default=default, metadata={"help": help, "choices": choices, "key": key, "needs": needs})


def _sub(cls, needs: Needs | None = None):
    return field(default_factory=cls, metadata={"section": True, "needs": needs})


def choices(cls, name: str) -> tuple:
    """The values field `name` of config section `cls` accepts (one list, here, for its flag and its component)."""
    return next(f for f in dataclasses.fields(cls) if f.name == name).metadata["choices"]


def _model(kind: str) -> Needs:
    return Needs(lambda c: c.model.kind == kind, f"--model {kind}")


# The gates that give every token k experts of the flat layer (moe/router/: the batchwise gate gives a token a
# variable number; the hierarchical one routes in two levels around the exchange).
_TOP_K_GATES = ("noisy_topk", "softmax_topk", "aux_free", "node_limited")


def _gate(*gates: str) -> Needs:
    return Needs(lambda c: c.moe.router.gate in gates, f"--gate {gates[0]}")


_MOE = Needs(lambda c: c.has_moe_ffn, "an MoE layer (--layout lstm-moe-lstm, or --model transformer --ffn moe)")
_ROUTED = Needs(lambda c: c.has_moe_ffn or c.model.kind == "transformer" and c.attention.kind == "moa",
                "an MoE layer or MoA attention (routed layers)")
_SAMPLED = Needs(lambda c: c.softmax.kind == "sampled", "--softmax sampled")
_STREAM = Needs(lambda c: c.data.stream, "--stream")
_SHARED = Needs(lambda c: c.moe.experts.shared > 0, "--shared-experts 1 or more")
_LLAMA = Needs(lambda c: c.model.transformer.block == "llama", "--block llama")


# Auxiliary-loss weights beyond this outweigh the language-model loss by orders of magnitude: clipping then spends
# the whole gradient on balance and the LM trains nothing (the papers use 0.001-0.1; Shazeer Table 6 tries 1).
MAX_AUX_WEIGHT = 10.0


def _aux_weights(**weights: float) -> None:
    for name, value in weights.items():
        if not 0.0 <= value <= MAX_AUX_WEIGHT:
            raise UserError(f"--{name.replace('_', '-')} {value:g} is outside [0, {MAX_AUX_WEIGHT:g}]: a balance "
                            f"loss weighted past {MAX_AUX_WEIGHT:g} outweighs the language-model loss and the model "
                            f"trains nothing; the papers use 0.001 to 0.1")


def _positive(**values: int | float) -> None:
    for name, value in values.items():
        if value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")


# ---------------------------------------------------------------- model


@dataclass
class LSTMConfig:
    layout: str = _f("lstm-moe-lstm", "LSTM LM: layer stack between embedding and softmax: App. C.1's model, or a "
                                      "computationally matched baseline: a dense FFN instead of the MoE "
                                      "(MoE-1-Deep), four LSTMs (4xLSTM-512), or one LSTM (LSTM-2048-512)",
                     ("lstm-moe-lstm", "lstm-ffn-lstm", "4xlstm", "lstm"))
    hidden: int = _f(0, "LSTM units (0: d_model); more than d_model adds an output projection back to d_model "
                        "(Sak et al. 2014)", key="lstm_hidden")
    ffn_layers: int = _f(1, "lstm-ffn-lstm: ReLU hidden layers of width expert_hidden in the dense FFN",
                         needs=Needs(lambda c: c.model.lstm.layout == "lstm-ffn-lstm", "--layout lstm-ffn-lstm"))

    def validate(self) -> None:
        if self.hidden < 0 or self.ffn_layers < 1:
            raise UserError(f"--lstm-hidden must be 0 (= d_model) or positive and --ffn-layers at least 1 "
                            f"(got {self.hidden}, {self.ffn_layers})")


@dataclass
class TransformerConfig:
    num_layers: int = _f(2, "transformer: decoder blocks")
    ffn: str = _f("dense", "transformer: feed-forward of every block: dense, or an MoE layer with --gate",
                  ("dense", "moe"))
    ffn_hidden: int = _f(256, "transformer: hidden width of the dense feed-forward")
    block: str = _f("default", "transformer: decoder block: pre-LayerNorm with sinusoidal positions, biases and GELU "
                               "(the original block), or Mixtral's: RMSNorm, rotary positions, SwiGLU FFN and "
                               "experts, no biases, its router (llama; exports as a native MixtralForCausalLM / "
                               "LlamaForCausalLM)", ("default", "llama"))
    tie_embeddings: bool = _f(False, "llama block: the output layer shares the embedding matrix (Mixtral: not tied)",
                              needs=_LLAMA)
    rope_theta: float = _f(10000.0, "llama block: base of the rotary positions' frequencies (Mixtral-8x7B: 1e6)",
                           needs=_LLAMA)
    qk_norm: bool = _f(False, "llama block: RMSNorm over each head's queries and keys before the rotary positions "
                              "(Qwen3's; an MoE FFN then exports as Qwen3MoeForCausalLM, a dense one as "
                              "Qwen3ForCausalLM)", needs=_LLAMA)
    rms_norm_eps: float = _f(1e-5, "llama block: epsilon of every RMSNorm (Mixtral, Llama 2: 1e-5; Qwen2/3: 1e-6)",
                             needs=_LLAMA)

    def validate(self) -> None:
        _positive(num_layers=self.num_layers, ffn_hidden=self.ffn_hidden)
        if not self.rope_theta > 1:
            raise UserError(f"--rope-theta must be larger than 1 (got {self.rope_theta:g}); Llama uses 10000, "
                            f"Mixtral 1e6")
        if not 0 < self.rms_norm_eps < 1:
            raise UserError(f"--rms-norm-eps {self.rms_norm_eps:g} must lie between 0 and 1 (1e-5 or 1e-6)")


@dataclass
class ModelConfig:
    kind: str = _f("lstm", "architecture: Shazeer's LSTM-MoE (App. C.1) or a decoder-only transformer LM",
                   ("lstm", "transformer"), key="model")
    d_model: int = _f(64, "embedding, LSTM and MoE input/output width")
    dropout: float = _f(0.1, "DropProb applied to every layer output but the softmax")
    lstm: LSTMConfig = _sub(LSTMConfig, _model("lstm"))
    transformer: TransformerConfig = _sub(TransformerConfig, _model("transformer"))

    def validate(self) -> None:
        _positive(d_model=self.d_model)
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--dropout must be in [0, 1) (got {self.dropout})")
        (self.transformer if self.kind == "transformer" else self.lstm).validate()


# ---------------------------------------------------------------- the MoE layer


@dataclass
class HierarchicalConfig:
    num_groups: int = _f(4, "hierarchical: primary groups a (each holds num_experts / a experts); --top-k is k "
                            "of the primary level")
    top_k_secondary: int = _f(2, "hierarchical: experts per token chosen inside each selected group")


@dataclass
class BatchwiseConfig:
    scope: str = _f("local", "batchwise: top-m per expert over this rank's batch, or over the whole data-parallel "
                             "batch", ("local", "global"), key="batchwise_scope")
    threshold_reduction: str = _f("mean", "batchwise: threshold loss as the paper's sum over the batch, or divided "
                                          "by the batch size", ("mean", "sum"))


@dataclass
class SoftmaxTopKConfig:
    aux_weight: float = _f(0.01, "softmax_topk: weight α of the switch-style load-balancing loss",
                           key="moa_aux_weight")
    z_weight: float = _f(0.001, "softmax_topk: weight β of the router z-loss", key="moa_z_weight")
    renormalize: str = _f("none", "softmax_topk: keep the top-k probabilities as they are (released code) or "
                                  "divide by their detached sum (paper eq. 9), or by their sum with its gradient "
                                  "(Mixtral: a softmax over the top-k logits)", ("none", "detached", "full"),
                          key="moa_renormalize")

    def validate(self) -> None:
        _aux_weights(moa_aux_weight=self.aux_weight, moa_z_weight=self.z_weight)


# An update rate this large moves the biases by a sigmoid score's whole range in one step: routing then follows the
# last step's load alone (DeepSeek-V3 uses 0.001).
MAX_BIAS_UPDATE_RATE = 1.0


@dataclass
class AuxFreeConfig:
    score: str = _f("sigmoid", "aux_free: expert scores: sigmoid, the chosen ones divided by their sum (DeepSeek-V3), "
                               "or softmax over all experts, the chosen ones kept as they are",
                    ("sigmoid", "softmax"), key="aux_free_score")
    bias_update_rate: float = _f(0.001, "aux_free: u in b_i += u·sign(mean load - load_i), applied to each "
                                        "expert's routing bias after every optimizer step (0: biases stay 0)")
    seq_balance_weight: float = _f(0.0, "aux_free: weight α of DeepSeek-V3's sequence-wise balance loss "
                                        "(eq. 17-20; 0: none, the paper uses 0.0001)")

    def validate(self) -> None:
        _aux_weights(seq_balance_weight=self.seq_balance_weight)
        if not 0.0 <= self.bias_update_rate <= MAX_BIAS_UPDATE_RATE:
            raise UserError(f"--bias-update-rate {self.bias_update_rate:g} is outside [0, "
                            f"{MAX_BIAS_UPDATE_RATE:g}]: each step moves the routing biases by it, a negative rate "
                            f"pushes the load apart and a larger one moves them by a sigmoid score's whole range; "
                            f"DeepSeek-V3 uses 0.001")


@dataclass
class NodeLimitedConfig:
    expert_groups: int = _f(0, "node_limited: G groups of consecutive experts, a token's experts coming from at most "
                               "--group-top-k of them (0: one group per expert-parallel rank, G = --ep-size; the "
                               "nodes the experts span, --ep-size / GPUs per node: M bounds the nodes a token's rows "
                               "cross to)")
    group_top_k: int = _f(1, "node_limited: M, the groups a token's k experts may come from (DeepSeek-V3's "
                             "topk_group), chosen by their score: the sum of their 2 best scores (+ routing biases)")
    normalize: bool = _f(True, "node_limited: the k chosen scores divided by their sum (DeepSeek-V3's norm_topk_prob)")
    routed_scaling_factor: float = _f(1.0, "node_limited: the gates multiplied by it (DeepSeek-V3: 2.5)")

    def validate(self) -> None:
        if self.expert_groups < 0 or self.group_top_k < 1:
            raise UserError(f"--expert-groups {self.expert_groups} must be 0 (the nodes) or more, and --group-top-k "
                            f"{self.group_top_k} at least 1")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise UserError(f"--routed-scaling-factor {self.routed_scaling_factor:g} must be a positive number "
                            f"(DeepSeek-V3 uses 2.5; 1 leaves the gates as they are)")


@dataclass
class RouterConfig:
    gate: str = _f("noisy_topk", "router: noisy top-k (Shazeer §2.1), two-level hierarchical (App. B), strictly "
                                 "balanced batchwise with learned thresholds (App. F), MoA's softmax top-k, or "
                                 "auxiliary-loss-free balancing by per-expert routing biases (DeepSeek-V3), or "
                                 "DeepSeek-V3's node-limited top-k (with those biases)",
                   ("noisy_topk", "hierarchical", "batchwise", "softmax_topk", "aux_free", "node_limited"))
    top_k: int = _f(2, "experts per token (k); k=1 gives the router no task-loss gradient")
    w_importance: float = _f(0.1, "weight of the CV^2(importance) loss (node_limited: 0 unless given)",
                             needs=_gate("noisy_topk", "hierarchical", "batchwise", "node_limited"))
    w_load: float = _f(0.1, "weight of the CV^2(load) loss (smooth load estimator)",
                       needs=_gate("noisy_topk", "hierarchical"))
    noisy_gating: bool = _f(True, "trainable Gaussian noise on the gate logits during training",
                            needs=_gate("noisy_topk", "hierarchical"))
    hierarchical: HierarchicalConfig = _sub(HierarchicalConfig, _gate("hierarchical"))
    batchwise: BatchwiseConfig = _sub(BatchwiseConfig, _gate("batchwise"))
    softmax_topk: SoftmaxTopKConfig = _sub(SoftmaxTopKConfig, Needs(   # also the router of MoA's attention experts
        lambda c: c.moe.router.gate == "softmax_topk" and c.has_moe_ffn
        or c.model.kind == "transformer" and c.attention.kind == "moa", "--gate softmax_topk or --attention moa",
        alone=True))
    aux_free: AuxFreeConfig = _sub(AuxFreeConfig, _gate("aux_free", "node_limited"))
    node_limited: NodeLimitedConfig = _sub(NodeLimitedConfig, _gate("node_limited"))
    force_balanced_routing: bool = _f(
        False, "benchmarks: the router runs and its losses count, but the tokens go to the experts round-robin "
               "(each gets the same share), as published Megatron/NeMo MoE throughputs are measured; not for "
               "training a model", needs=Needs(lambda c: c.has_moe_ffn and c.moe.router.gate in _TOP_K_GATES,
                                               "an MoE layer with a gate that gives every token k experts (--gate "
                                               + ", ".join(_TOP_K_GATES) + ")"))

    def validate(self, num_experts: int, ep_size: int) -> None:
        _positive(top_k=self.top_k)
        _aux_weights(w_importance=self.w_importance, w_load=self.w_load)
        self.softmax_topk.validate()
        self.aux_free.validate()
        self.node_limited.validate()
        if self.top_k > num_experts:
            raise UserError(f"--top-k {self.top_k} is larger than --num-experts {num_experts}; "
                            f"choose k <= number of experts")
        if self.gate == "aux_free" and self.aux_free.score == "sigmoid" and self.top_k == 1:
            raise UserError("--gate aux_free with --top-k 1 and sigmoid scores: the one chosen score divided by "
                            "itself is always 1, so the router's weights would never get a gradient (and this gate "
                            "has no balance loss); use --top-k 2 or more, or --aux-free-score softmax")
        if self.gate == "node_limited":
            self._validate_node_limited(num_experts, ep_size)
        if self.gate == "hierarchical":
            h = self.hierarchical
            if h.num_groups < 1 or num_experts % h.num_groups:
                raise UserError(f"--num-groups {h.num_groups} must divide --num-experts {num_experts} "
                                f"(a groups x b experts = n)")
            per_group = num_experts // h.num_groups
            if self.top_k > h.num_groups:
                raise UserError(f"--top-k {self.top_k} (primary k) is larger than --num-groups {h.num_groups}")
            if not 1 <= h.top_k_secondary <= per_group:
                raise UserError(f"--top-k-secondary {h.top_k_secondary} must be between 1 and the {per_group} "
                                f"experts per group")
            if h.num_groups % ep_size:
                raise UserError(f"--num-groups {h.num_groups} is not divisible by --ep-size {ep_size}; each "
                                f"group's experts must live on one expert-parallel rank")

    def _validate_node_limited(self, num_experts: int, ep_size: int) -> None:
        groups, m = self.node_limited.expert_groups or ep_size, self.node_limited.group_top_k
        if groups and num_experts % groups:
            raise UserError(f"--expert-groups {groups} must divide --num-experts {num_experts} (groups of "
                            f"consecutive experts)")
        if groups and m > groups:
            raise UserError(f"--group-top-k {m} is more than the --expert-groups {groups}")
        if groups and self.top_k > m * (num_experts // groups):
            raise UserError(f"--top-k {self.top_k} experts cannot come from {m} group(s) of "
                            f"{num_experts // groups}; raise --group-top-k or lower --top-k")
        if self.aux_free.score == "sigmoid" and self.top_k == 1 and self.node_limited.normalize:
            raise UserError("--gate node_limited with --top-k 1, sigmoid scores and normalised gates: the one chosen "
                            "score divided by itself is always 1, so the router would get no gradient; use --top-k 2 "
                            "or more, --aux-free-score softmax, or --no-normalize")


@dataclass
class DispatchConfig:
    mode: str = _f("dropless", "token dispatch: every routed copy reaches its expert, or each expert takes at most "
                               "capacity_factor x its fair share and the lowest-gate copies are dropped",
                   ("dropless", "capacity"), key="dispatch")
    capacity_factor: float = _f(1.0, "capacity dispatch: expert capacity = ceil(factor x tokens x k / experts)",
                                needs=Needs(lambda c: c.moe.dispatch.mode == "capacity", "--dispatch capacity"))
    rank_capacity_factor: float = _f(0.0, "dropless dispatch: each rank sends each expert-parallel rank at most "
                                          "ceil(F x its pairs / ranks) (token, expert) pairs, dropping the lowest "
                                          "gates beyond (counted and logged as dropped_fraction), so no rank "
                                          "receives more than F x the balanced load (0: no budget)",
                                     needs=Needs(lambda c: c.moe.dispatch.mode == "dropless", "--dispatch dropless"))
    all_to_all: str = _f("flat", "token exchange: one all-to-all over the expert-parallel group, or within each "
                                 "node first and then across nodes", ("flat", "hierarchical"))
    node_size: int = _f(0, "hierarchical all-to-all: ranks per node (0: the launcher's LOCAL_WORLD_SIZE)",
                        needs=Needs(lambda c: c.moe.dispatch.all_to_all == "hierarchical", "--all-to-all hierarchical"))
    a2a_chunks: int = _f(1, "split each MoE layer's exchange into this many pieces, exchanged while the experts "
                            "compute the piece before (asynchronous all-to-alls; one count read whatever the "
                            "pieces; docs/performance.md#overlapping-the-exchange)",
                         needs=Needs(lambda c: c.has_moe_ffn and c.moe.router.gate in _TOP_K_GATES,
                                     "an MoE layer with a gate that gives every token k experts (--gate "
                                     + ", ".join(_TOP_K_GATES) + ")"))

    def validate(self) -> None:
        if not self.capacity_factor > 0:
            raise UserError(f"--capacity-factor must be positive (got {self.capacity_factor}); 1.0 gives each "
                            f"expert exactly its fair share of tokens x k / experts")
        if self.a2a_chunks < 1:
            raise UserError(f"--a2a-chunks must be 1 (one exchange) or more (got {self.a2a_chunks})")
        if self.node_size < 0:
            raise UserError(f"--node-size must be 0 (from the launcher) or a positive rank count (got "
                            f"{self.node_size})")
        if not (self.rank_capacity_factor == 0 or 1 <= self.rank_capacity_factor < math.inf):
            raise UserError(f"--rank-capacity-factor {self.rank_capacity_factor:g} must be 0 (no budget) or a number "
                            f"of 1 or more (the balanced load is 1; Megatron-Core's examples use 1.5 to 4)")


# moe/experts/kinds.py's EXPERT_KINDS (tests/moe/experts/test_kinds.py holds the two equal), and the block's
EXPERT_KIND_CHOICES = ("block", "relu", "swiglu", "geglu")


@dataclass
class ExpertsConfig:
    num_experts: int = _f(16, "experts in the MoE layer")
    hidden: int = _f(128, "hidden width of each expert FFN", key="expert_hidden", needs=Needs(   # also the LSTM's FFN
        lambda c: c.has_moe_ffn or c.model.kind == "lstm" and c.model.lstm.layout == "lstm-ffn-lstm", _MOE.flags,
        alone=True))
    kind: str = _f("block", "the experts' FFN: relu (Shazeer et al. 2017's), swiglu (Mixtral's) or geglu "
                            "(GELU-gated; Shazeer 2020); block: the block's (relu; swiglu for --block llama). "
                            "moe_scale/moe/experts/kinds.py", EXPERT_KIND_CHOICES, key="expert_kind")
    recompute: bool = _f(False, "recompute the experts' hidden activations in the backward pass instead of "
                                "storing them (Shazeer et al. App. D)", key="expert_recompute")
    shared: int = _f(0, "shared experts: always-active FFN experts whose output is added to the routed one "
                        "(DeepSeekMoE, Qwen2-MoE); dense parameters on every rank, not expert-parallel",
                     key="shared_experts")
    shared_hidden: int = _f(0, "hidden width of each shared expert (0: --expert-hidden)", key="shared_expert_hidden",
                            needs=_SHARED)
    shared_gate: bool = _f(False, "scale the shared experts' output per token by sigmoid(x·w_g), a learned gate "
                                  "(Qwen2-MoE)", key="shared_expert_gate", needs=_SHARED)
    tensor_parallel: int = _f(1, "expert tensor parallelism: each expert's hidden units split over this many ranks "
                                 "(its first layer by columns, its second by rows), beside --ep-size: experts live "
                                 "on groups of ep-size x etp-size ranks, so 8 experts can use 16 GPUs "
                                 "(docs/routing.md#expert-tensor-parallelism)", key="etp_size",
                              needs=Needs(lambda c: c.has_moe_ffn
                                          and not (c.model.kind == "transformer" and c.attention.kind == "moa"),
                                          "an MoE layer without --attention moa (its attention experts are not "
                                          "split)"))
    grad_reuse: bool = _f(True, "CPU: write the expert weights' gradients into the memory of the last ones, not "
                                "onto fresh pages the kernel must zero first (faster; that memory, one gradient "
                                "per expert weight, stays allocated between steps)", key="expert_grad_reuse")

    def validate(self, ep_size: int) -> None:
        _positive(num_experts=self.num_experts, expert_hidden=self.hidden, etp_size=self.tensor_parallel)
        if self.hidden % self.tensor_parallel:
            raise UserError(f"--etp-size {self.tensor_parallel} does not divide --expert-hidden {self.hidden}: each "
                            f"of the {self.tensor_parallel} ranks holds an equal share of an expert's hidden units")
        if self.shared < 0 or self.shared_hidden < 0:
            raise UserError(f"--shared-experts and --shared-expert-hidden must not be negative (got {self.shared}, "
                            f"{self.shared_hidden}); 0 shared experts is the plain MoE layer")
        if self.num_experts % ep_size:
            raise UserError(f"--num-experts {self.num_experts} is not divisible by --ep-size {ep_size}; "
                            f"each expert-parallel rank must hold the same number of experts")


@dataclass
class MoEConfig:
    router: RouterConfig = _sub(RouterConfig)
    dispatch: DispatchConfig = _sub(DispatchConfig)
    experts: ExpertsConfig = _sub(ExpertsConfig)

    def validate(self, ep_size: int) -> None:
        self.experts.validate(ep_size)
        self.router.validate(self.experts.num_experts, ep_size)
        self.dispatch.validate()


# ---------------------------------------------------------------- attention (transformer)


@dataclass
class MoAConfig:
    num_experts: int = _f(8, "moa: attention experts per layer (E)", key="moa_num_experts")
    top_k: int = _f(2, "moa: attention experts per query token (k)", key="moa_top_k")


@dataclass
class MAEConfig:
    g_every: int = _f(5, "mae: G steps (gate only) on one epoch (or step, --mae-g-unit) in every n, each before the "
                         "F step on the same batch (Alg. 3)", key="mae_g_every")
    g_unit: str = _f("epoch", "mae: what --mae-g-every counts", ("epoch", "step"), key="mae_g_unit")
    training: str = _f("bcd", "mae: block coordinate descent (G and F steps), or the NoBCD ablation: gate and model "
                              "trained jointly through the mixture", ("bcd", "joint"), key="mae_training")
    gate_lr: float = _f(1.0, "mae: plain-SGD learning rate of the gate in G steps", key="mae_gate_lr")


@dataclass
class AttentionConfig:
    kind: str = _f("mha", "transformer: attention of every layer: multi-head with head masks, MoA attention "
                          "experts, or MAE (mixture of h-1 heads)", ("mha", "moa", "mae"), key="attention")
    num_heads: int = _f(4, "transformer: heads per attention layer (mha, mae); MoA uses --moa-top-k",
                        needs=Needs(lambda c: c.attention.kind != "moa",
                                    "--attention mha or mae (MoA uses --moa-top-k)"))
    head_dim: int = _f(0, "transformer: width per head (0: d_model / num_heads)")
    moa: MoAConfig = _sub(MoAConfig, Needs(lambda c: c.attention.kind == "moa", "--attention moa"))
    mae: MAEConfig = _sub(MAEConfig, Needs(lambda c: c.attention.kind == "mae", "--attention mae"))

    def head_width(self, d_model: int) -> int:
        """Width of one head (MHA/MAE) or one attention expert (MoA): --head-dim, or d_model / heads."""
        if self.head_dim:
            return self.head_dim
        return d_model // (self.moa.top_k if self.kind == "moa" else self.num_heads)

    def validate(self, d_model: int, ep_size: int) -> None:
        _positive(num_heads=self.num_heads, moa_num_experts=self.moa.num_experts, moa_top_k=self.moa.top_k,
                  mae_g_every=self.mae.g_every)
        if self.head_dim < 0:
            raise UserError(f"--head-dim must be 0 (d_model / heads) or positive (got {self.head_dim})")
        if self.kind == "moa" and self.moa.top_k > self.moa.num_experts:
            raise UserError(f"--moa-top-k {self.moa.top_k} is larger than --moa-num-experts {self.moa.num_experts}; "
                            f"choose k <= number of attention experts")
        heads, flag = (self.moa.top_k, "--moa-top-k") if self.kind == "moa" else (self.num_heads, "--num-heads")
        if not self.head_dim and d_model % heads:
            raise UserError(f"{flag} {heads} does not divide --d-model {d_model}; choose a divisor of the width "
                            f"or set --head-dim explicitly")
        if self.kind == "moa" and self.moa.num_experts % ep_size:
            raise UserError(f"--moa-num-experts {self.moa.num_experts} is not divisible by --ep-size {ep_size}; "
                            f"each expert-parallel rank must hold the same number of attention experts")
        if self.kind == "mae" and self.num_heads < 2:
            raise UserError(f"--attention mae needs --num-heads >= 2 (experts are groups of h-1 heads; got "
                            f"{self.num_heads})")
        if self.mae.gate_lr <= 0:
            raise UserError(f"--mae-gate-lr must be positive (got {self.mae.gate_lr})")


# ---------------------------------------------------------------- output layer, data, training, parallelism, run


@dataclass
class SoftmaxConfig:
    kind: str = _f("full", "output layer: exact softmax, importance-sampled softmax in training (exact at eval; "
                           "Jozefowicz et al. 2016), or adaptive softmax", ("full", "sampled", "adaptive"),
                   key="softmax")
    num_sampled: int = _f(8192, "sampled softmax: classes drawn per batch (shared by all its tokens)", needs=_SAMPLED)
    sampler: str = _f("log_uniform", "sampled softmax proposal: Zipfian over frequency-sorted ids, or the training "
                                     "unigram counts", ("log_uniform", "unigram"), needs=_SAMPLED)
    adaptive_cutoffs: str = _f("2000,10000", "adaptive softmax: comma-separated cluster boundaries (word ids)",
                               needs=Needs(lambda c: c.softmax.kind == "adaptive", "--softmax adaptive"))

    def validate(self, vocab_size: int) -> None:
        if self.kind == "sampled" and self.num_sampled < 1:
            raise UserError(f"--num-sampled must be at least 1 (got {self.num_sampled})")
        if self.kind == "sampled" and self.num_sampled >= vocab_size:
            raise UserError(f"--num-sampled {self.num_sampled} is not smaller than --vocab-size {vocab_size}; "
                            "sample fewer classes or use --softmax full")
        if self.kind == "adaptive":
            cutoffs = parse_cutoffs(self.adaptive_cutoffs)
            if cutoffs[-1] >= vocab_size:
                raise UserError(f"--adaptive-cutoffs {self.adaptive_cutoffs}: the last cutoff must be below "
                                f"--vocab-size {vocab_size}")


def parse_cutoffs(text: str) -> list[int]:
    try:
        cutoffs = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--adaptive-cutoffs {text!r} is not a comma-separated list of integers; "
                        "use e.g. --adaptive-cutoffs 2000,10000") from None
    if not cutoffs or any(b <= a for a, b in zip(cutoffs, cutoffs[1:])) or cutoffs[0] < 1:
        raise UserError(f"--adaptive-cutoffs {text!r} must be increasing positive word ids, e.g. 2000,10000")
    return cutoffs


@dataclass
class DataConfig:
    data: str = _f("embedded", "training text: 'embedded' (built-in corpus), a file, a directory, or a glob "
                               "of one-sentence-per-line files")
    valid_data: str | None = _f(None, "validation text (default: the files beside --data the split rule names "
                                      "valid (docs/data.md), else held out)")
    test_data: str | None = _f(None, "test text (default: the files beside --data the split rule names test, "
                                     "else held out)")
    holdout_fraction: float = _f(0.02, "share of training sentences held out for valid+test when none given")
    tokenizer: str = _f("words", "words (whitespace-separated words: pre-tokenised text such as the 1B-word "
                                 "benchmark), bpe (a byte-level BPE learned from the training text, no <UNK>), or "
                                 "the path of a tokenizer.json; perplexity is per word with every tokenizer")
    vocab_size: int = _f(10000, "largest vocabulary, including <UNK>, <S>, </S> (bpe: its size; a "
                                "tokenizer.json keeps its own)")
    min_count: int = _f(1, "drop words seen fewer times than this from the vocabulary")
    seq_len: int = _f(32, "tokens per training window (truncated back-propagation length)")
    stream: bool = _f(False, "stream the training shards (never loads them into memory; the position is "
                             "checkpointed) instead of loading them")
    shuffle_buffer: int = _f(10000, "streaming: sentences in the shuffle buffer of each reader (0 or 1: no shuffle)",
                             needs=_STREAM)
    stream_workers: int = _f(1, "streaming: shard readers per rank (shards are split over ranks x readers)",
                             needs=_STREAM)
    token_budget: int = _f(0, "streaming: stop after this many training tokens (0: --max-steps); one pass, "
                              "training also stops when the data runs out", needs=_STREAM)

    def validate(self) -> None:
        _positive(seq_len=self.seq_len, min_count=self.min_count)
        if not 0.0 < self.holdout_fraction < 0.5:
            raise UserError(f"--holdout-fraction must be in (0, 0.5) (got {self.holdout_fraction})")
        if self.vocab_size < 4:
            raise UserError(f"--vocab-size must be at least 4 (3 special symbols and a word); got {self.vocab_size}")
        if not self.tokenizer.strip():
            raise UserError("--tokenizer is empty; use words, bpe or the path of a tokenizer.json")
        if min(self.shuffle_buffer, self.token_budget) < 0 or self.stream_workers < 1:
            raise UserError("--shuffle-buffer and --token-budget must not be negative and --stream-workers must be "
                            "at least 1")
        if self.token_budget and not self.stream:
            raise UserError("--token-budget needs --stream (one pass over streamed shards); with in-memory data "
                            "use --max-steps")


@dataclass
class TrainConfig:
    batch_size: int = _f(64, "global batch: sequences per optimizer step over all ranks")
    grad_accum: int = _f(1, "micro-batches accumulated per optimizer step")
    max_steps: int = _f(600, "optimizer steps to train")
    lr: float = _f(3e-3, "peak Adam learning rate")
    warmup_steps: int = _f(100, "linear warm-up steps, then lr ∝ 1/sqrt(step) (Shazeer et al. App. C.1)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    optimizer: str = _f("adam", "AdamW everywhere, or for expert matrices a factored second moment without first "
                                "moment (Shazeer et al. App. D) and AdamW for the rest", ("adam", "factored"))
    seed: int = _f(1234, "seed for initialisation, data order, dropout and gate noise")
    noise_rng: str = _f("rank", "gate noise per rank, or drawn per global token so any world size draws the "
                                "same noise (costs global tokens x experts memory)", ("rank", "global"))
    init_from_hf: str | None = _f(None, "start from the weights of a native MixtralForCausalLM / LlamaForCausalLM "
                                        "directory (`moe-scale export` of a --block llama run, or one of the same "
                                        "shapes and tokenizer) instead of a random initialisation", needs=_LLAMA)
    preset: str | None = _f(None, "start from a paper model's settings (`moe-scale flops --list`; NAME-mini for a "
                                  "CPU-sized miniature); other flags given override them")
    upcycle_from: str | None = _f(None, "start this MoE run from a trained dense run (sparse upcycling: every expert "
                                        "a copy of its FFN, a new router, the rest its weights and tokenizer)")
    upcycle_noise: float = _f(0.0, "with --upcycle-from: multiply each copied expert weight by 1 + this x N(0, 1), "
                                   "so the experts start apart", needs=Needs(lambda c: c.train.upcycle_from is not None,
                                                                             "--upcycle-from RUN"))

    def validate(self) -> None:
        _positive(batch_size=self.batch_size, grad_accum=self.grad_accum, max_steps=self.max_steps)
        if min(self.lr, self.weight_decay, self.warmup_steps) < 0:
            raise UserError("--lr, --weight-decay and --warmup-steps must not be negative")
        if not 0.0 <= self.upcycle_noise < 1.0:
            raise UserError(f"--upcycle-noise must be in [0, 1) (got {self.upcycle_noise}); 0.01 makes the copies "
                            f"differ by about 1%")


@dataclass
class ParallelConfig:
    ep_size: int = _f(1, "expert-parallel ranks: experts are split over groups of this many ranks")
    ds_config: str | None = _f(None, "DeepSpeed JSON (default: the built-in CPU config, ds_configs/cpu.json)")
    vocab_exchange: str = _f("rows", "with --ep-size > 1: the embedding and output tables split by rows over the "
                                     "expert-parallel ranks, each batch's rows or hidden states exchanged (rows), "
                                     "or whole on every rank with their gradients all-reduced (dense: for "
                                     "comparison); docs/scale-paper.md", choices=("rows", "dense"))

    def validate(self) -> None:
        _positive(ep_size=self.ep_size)


@dataclass
class RunDirConfig:
    out: str = _f("runs/lstm-moe", "run directory: config, vocab, summary, TensorBoard events, checkpoints")
    resume: bool = _f(False, "continue from the latest complete checkpoint in --out")
    overwrite: bool = _f(False, "replace an existing run in --out")
    log_interval: int = _f(50, "steps between log lines and TensorBoard points")
    eval_interval: int = _f(200, "steps between validation passes (and at the end)")
    eval_max_batches: int = _f(0, "cap on validation batches per pass (0: the whole split)")
    checkpoint_interval: int = _f(200, "steps between checkpoints (and at the end); 0: never (benchmarks: such a "
                                       "run cannot be resumed or evaluated)")
    resume_from: str | None = _f(None, "with --resume: continue from this checkpoint (a tag such as step00000400 in "
                                       "--out/checkpoints) instead of the newest complete one",
                                 needs=Needs(lambda c: c.run.resume, "--resume"))
    keep_checkpoints: int = _f(2, "complete checkpoints kept in --out/checkpoints, the newest (each save deletes "
                                  "older ones); 0: keep them all")
    accept_changed_data: bool = _f(False, "with --resume: go on although the data files differ from those the run "
                                          "started on (recorded in data_files.json; the log says so)",
                                   needs=Needs(lambda c: c.run.resume, "--resume"))
    record_routes: str | None = _f(None, "write each routed layer's chosen experts per token of every training "
                                         "forward to this directory (router replay: docs/routing.md)", needs=_ROUTED)
    replay_routes: str | None = _f(None, "route every training forward by the experts recorded in this directory "
                                         "(--record-routes), the gates from the live router's scores", needs=_ROUTED)

    def validate(self) -> None:
        _positive(log_interval=self.log_interval, eval_interval=self.eval_interval)
        if self.eval_max_batches < 0:
            raise UserError("--eval-max-batches must not be negative")
        if self.checkpoint_interval < 0:
            raise UserError(f"--checkpoint-interval must be 0 (never) or positive (got {self.checkpoint_interval})")
        if self.keep_checkpoints < 0:
            raise UserError(f"--keep-checkpoints must be 0 (keep all) or positive (got {self.keep_checkpoints})")
        if self.resume and self.overwrite:
            raise UserError("--resume and --overwrite contradict each other; pass one of them")
        if self.record_routes and self.record_routes == self.replay_routes:
            raise UserError("--record-routes and --replay-routes name the same directory; record into another one")


# ---------------------------------------------------------------- the whole run


@dataclass(frozen=True)
class Leaf:
    """One setting: its key (= flag name and preset key), where it lives, and its field."""

    key: str
    path: tuple[str, ...]
    field: dataclasses.Field
    type: Any
    section: str   # the top-level component, for --help's groups
    needs: tuple[Needs, ...] = ()   # what it needs to apply: its sections', outermost first, then its own

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


UNIGRAM_NEEDS_WORD_COUNTS = ("--sampler unigram needs the training counts of every token, which only --tokenizer "
                             "words keeps (vocab.counts beside the vocabulary); use --sampler log_uniform, or "
                             "--tokenizer words")


@dataclass
class RunConfig:
    model: ModelConfig = _sub(ModelConfig)
    moe: MoEConfig = _sub(MoEConfig, _MOE)
    attention: AttentionConfig = _sub(AttentionConfig, _model("transformer"))
    softmax: SoftmaxConfig = _sub(SoftmaxConfig)
    data: DataConfig = _sub(DataConfig)
    train: TrainConfig = _sub(TrainConfig)
    parallel: ParallelConfig = _sub(ParallelConfig)
    run: RunDirConfig = _sub(RunDirConfig)

    # ------------------------------------------------------------ leaves by key

    @classmethod
    def leaves(cls) -> dict[str, Leaf]:
        """Every setting by key, in the tree's order."""
        return dict(_LEAVES)

    @classmethod
    def from_settings(cls, **settings: Any) -> "RunConfig":
        """The defaults with these settings, given by key: `RunConfig.from_settings(num_experts=64, top_k=4)`."""
        config = cls()
        for key, value in settings.items():
            config.set(key, value)
        return config

    def get(self, key: str) -> Any:
        leaf = _leaf(key)
        node = self
        for name in leaf.path:
            node = getattr(node, name)
        return node

    def set(self, key: str, value: Any) -> None:
        leaf = _leaf(key)
        node = self
        for name in leaf.path[:-1]:
            node = getattr(node, name)
        setattr(node, leaf.path[-1], value)

    # ------------------------------------------------------------ files

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> "RunConfig":
        if not isinstance(raw, dict):
            raise UserError(f"{source}: expected a JSON object with the sections {[f.name for f in _fields(cls)]}")
        raw = dict(raw)
        version = raw.pop("format", 1)
        if version == 1:
            return cls._from_flat(raw, source)
        if version != FORMAT:
            raise UserError(f"{source}: format {version!r} is newer than this moe_scale reads ({FORMAT}); "
                            f"update moe_scale")
        config = cls()
        _fill(config, raw, source, "")
        return config

    @classmethod
    def _from_flat(cls, raw: dict[str, Any], source: str) -> "RunConfig":
        """Format 1: sections model, data, train holding flat keys; every key is a leaf's key."""
        sections = ("model", "data", "train")
        unknown = set(raw) - set(sections)
        if unknown:
            raise UserError(f"{source}: unknown section(s) {sorted(unknown)}; allowed: {sorted(sections)} (format 1) "
                            f"or {[f.name for f in _fields(cls)]} with \"format\": {FORMAT}")
        config = cls()
        for section in sections:
            values = raw.get(section, {})
            if not isinstance(values, dict):
                raise UserError(f"{source}: section '{section}' must be an object")
            bad = sorted(k for k in values if k not in _LEAVES)
            if bad:
                raise UserError(f"{source}: unknown key(s) {bad} in section '{section}'; see `moe-scale train "
                                f"--help` for the valid settings")
            for key, value in values.items():
                _check_type(_LEAVES[key], value, f"{source}: '{section}.{key}'")
                config.set(key, value)
        return config

    def save(self, path: Path) -> None:
        from moe_scale.files import write_json_atomic

        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        path = Path(path)
        if path.is_dir():
            path = RunFiles(path).config
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"--config {path}: no such file; pass a run's config.json or its run directory")
        except json.JSONDecodeError as e:
            raise UserError(f"--config {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})")
        config = cls.from_dict(raw, f"--config {path}")
        config.validate()
        return config

    def resolve_implied_defaults(self, given: set[str]) -> None:
        """What a block or a gate implies unless `given` sets it: the llama block with an MoE FFN routes as Mixtral
        (--gate softmax_topk --moa-renormalize full; validate() refuses other gates for it); the node-limited gate
        balances by its routing biases, without a CV² loss (--w-importance 0)."""
        if self.model.kind == "transformer" and self.model.transformer.block == "llama" \
                and self.model.transformer.ffn == "moe":
            if "gate" not in given:
                self.moe.router.gate = "softmax_topk"
            if "moa_renormalize" not in given:
                self.moe.router.softmax_topk.renormalize = "full"
        if self.moe.router.gate == "node_limited" and "w_importance" not in given:
            self.moe.router.w_importance = 0.0   # DeepSeek-V3 balances by its biases; a CV² loss on request

    @property
    def expert_kind(self) -> str:
        """The experts' kind (moe/experts/kinds.py), the block's when --expert-kind is `block`: the llama block's
        SwiGLU (Mixtral's), else ReLU (the paper's). The shared experts are of the same kind."""
        kind = self.moe.experts.kind
        return self.block_expert_kind if kind == "block" else kind

    @property
    def block_expert_kind(self) -> str:
        """The kind of the block's own dense FFN, and of its experts by default."""
        llama = self.model.kind == "transformer" and self.model.transformer.block == "llama"
        return "swiglu" if llama else "relu"

    @property
    def etp_size(self) -> int:
        """The hidden shards of each expert of the MoE feed-forward layers (--etp-size; 1: whole experts)."""
        return self.moe.experts.tensor_parallel if self.has_moe_ffn else 1

    @property
    def expert_ranks(self) -> int:
        """The ranks one copy of every expert spans: --ep-size x --etp-size (the expert-model-parallel group)."""
        return self.parallel.ep_size * self.etp_size

    @property
    def has_moe_ffn(self) -> bool:
        """Whether the model has MoE feed-forward layers (the LSTM LM's middle, or the transformer's FFNs)."""
        if self.model.kind == "transformer":
            return self.model.transformer.ffn == "moe"
        return self.model.lstm.layout == "lstm-moe-lstm"

    def inapplicable(self, key: str) -> str | None:
        """Why setting `key` does nothing in this configuration (None: it applies), from what its field and the
        sections above it need. A flag given for a model that does not have what it sets is refused rather than
        ignored."""
        missing = [needs.flags for needs in _LEAVES[key].needs if not needs.applies(self)]
        return f"it needs {missing[0]}" if missing else None

    # ------------------------------------------------------------ checks

    def validate(self) -> None:
        """Checks that need no data or processes; the trainer checks world-size-dependent ones."""
        for key, leaf in _LEAVES.items():
            value = self.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{leaf.flag} {value}: must be a finite number")
        ep = self.parallel.ep_size
        self.parallel.validate()
        self.model.validate()
        self.moe.validate(ep)
        if self.model.kind == "transformer":
            self.attention.validate(self.model.d_model, ep)
            if self.model.transformer.block == "llama":
                self._validate_llama_block()
            if self.attention.kind == "mae" and self.attention.mae.training == "bcd" \
                    and self.attention.mae.g_unit == "epoch" and self.data.stream:
                raise UserError("--mae-g-unit epoch needs epochs, and streamed data (--stream) is one pass; "
                                "pass --mae-g-unit step")
        self.softmax.validate(self.data.vocab_size)
        if self.softmax.kind == "sampled" and self.softmax.sampler == "unigram" and self.data.tokenizer != "words":
            raise UserError(UNIGRAM_NEEDS_WORD_COUNTS)   # before a BPE is learned: only the word vocabulary counts
        self.data.validate()
        self.train.validate()
        self.run.validate()

    def _validate_llama_block(self) -> None:
        """--block llama is Mixtral's architecture (Llama's with a dense FFN): what it cannot express is refused."""
        fix = "; the llama block is Mixtral's architecture"
        if self.attention.kind != "mha":
            raise UserError(f"--block llama has multi-head attention with rotary positions, not --attention "
                            f"{self.attention.kind}; pass --attention mha or --block default")
        if self.attention.head_width(self.model.d_model) % 2:
            raise UserError(f"--block llama rotates pairs of each head's dimensions: the head width "
                            f"{self.attention.head_width(self.model.d_model)} must be even; set --head-dim or "
                            f"--num-heads accordingly")
        if self.softmax.kind == "adaptive":
            raise UserError(f"--block llama has one output matrix (lm_head): pass --softmax full or sampled, not "
                            f"adaptive{fix}")
        if self.model.transformer.ffn == "moe":
            router = self.moe.router
            if router.gate != "softmax_topk" or router.softmax_topk.renormalize != "full":
                raise UserError(f"--block llama routes as Mixtral (softmax over the experts, top-k, gates "
                                f"renormalised with their gradient): pass --gate softmax_topk --moa-renormalize full "
                                f"(what --block llama sets unless given), not --gate {router.gate} "
                                f"--moa-renormalize {router.softmax_topk.renormalize}")
            if self.moe.dispatch.mode != "dropless":
                raise UserError(f"--block llama sends every token to its k experts, as Mixtral does: pass --dispatch "
                                f"dropless, not {self.moe.dispatch.mode}{fix}")
            if self.moe.experts.shared and not self.moe.experts.shared_gate:
                raise UserError(f"--shared-experts {self.moe.experts.shared}: the llama block's shared experts are "
                                f"Qwen2-MoE's, whose output always passes a sigmoid gate; add --shared-expert-gate "
                                f"(or drop --shared-experts)")


def _fields(cls) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(cls)


def _walk(cls, path: tuple[str, ...], section: str, needs: tuple[Needs, ...] = ()) -> Iterator[Leaf]:
    hints = typing.get_type_hints(cls)
    for f in _fields(cls):
        own = f.metadata.get("needs")
        inner = needs if own is None else (own,) if own.alone else needs + (own,)
        if f.metadata.get("section"):
            yield from _walk(hints[f.name], path + (f.name,), section or f.name, inner)
        else:
            yield Leaf(f.metadata.get("key") or f.name, path + (f.name,), f, hints[f.name], section, inner)


def _build_leaves() -> dict[str, Leaf]:
    leaves: dict[str, Leaf] = {}
    for leaf in _walk(RunConfig, (), ""):
        if leaf.key in leaves:
            raise AssertionError(f"config key {leaf.key!r} is used twice: {leaves[leaf.key].path} and {leaf.path}")
        leaves[leaf.key] = leaf
    return leaves


_LEAVES = _build_leaves()


def _leaf(key: str) -> Leaf:
    try:
        return _LEAVES[key]
    except KeyError:
        raise KeyError(f"no setting {key!r}") from None


def _check_type(leaf: Leaf, value: Any, where: str) -> None:
    """A value read from a file must have its setting's type (JSON has no other check)."""
    base = leaf.type
    allowed = tuple(a for a in typing.get_args(base) if a is not type(None)) or (base,)
    if value is None and type(None) in typing.get_args(base):
        return
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return
    if not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool)):
        names = "/".join(a.__name__ for a in allowed)
        raise UserError(f"{where} must be {names}, got {value!r}; fix or delete the key")
    choices = leaf.field.metadata.get("choices")
    if choices and value not in choices:
        raise UserError(f"{where} must be one of {', '.join(choices)}, got {value!r}")


def _fill(node, raw: Any, source: str, where: str) -> None:
    """Set a component's fields from its JSON object, recursively; unknown keys and wrong types are one line."""
    if not isinstance(raw, dict):
        raise UserError(f"{source}: '{where or 'the top level'}' must be an object")
    hints = typing.get_type_hints(type(node))
    fields = {f.name: f for f in _fields(type(node))}
    bad = sorted(set(raw) - set(fields))
    if bad:
        raise UserError(f"{source}: unknown key(s) {bad} in '{where or 'the top level'}'; see `moe-scale train "
                        f"--help` for the valid settings")
    for name, value in raw.items():
        path = f"{where}.{name}" if where else name
        if fields[name].metadata.get("section"):
            _fill(getattr(node, name), value, source, path)
        else:
            leaf = Leaf(fields[name].metadata.get("key") or name, (), fields[name], hints[name], "")
            _check_type(leaf, value, f"{source}: '{path}'")
            setattr(node, name, value)
