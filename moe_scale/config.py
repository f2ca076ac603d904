"""Typed run configuration: one tree of dataclasses, one flag per field, saved with every run.

`moe-scale train --help` is generated from these fields (a field `num_experts` is the flag
`--num-experts`), so a flag and the saved `config.json` key never drift apart.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_scale.errors import UserError


def _f(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ModelConfig:
    d_model: int = _f(64, "embedding, LSTM and MoE input/output width")
    expert_hidden: int = _f(128, "hidden width of each expert FFN")
    num_experts: int = _f(16, "experts in the MoE layer")
    top_k: int = _f(2, "experts per token (k); k=1 gives the router no task-loss gradient")
    dropout: float = _f(0.1, "DropProb applied to every layer output but the softmax")
    w_importance: float = _f(0.1, "weight of the CV^2(importance) loss")
    w_load: float = _f(0.1, "weight of the CV^2(load) loss (smooth load estimator)")
    noisy_gating: bool = _f(True, "trainable Gaussian noise on the gate logits during training")
    gate: str = _f("noisy_topk", "router: noisy top-k (Shazeer §2.1), two-level hierarchical (App. B), strictly "
                                 "balanced batchwise with learned thresholds (App. F), or MoA's softmax top-k",
                   ("noisy_topk", "hierarchical", "batchwise", "softmax_topk"))
    num_groups: int = _f(4, "hierarchical: primary groups a (each holds num_experts / a experts); --top-k is k "
                            "of the primary level")
    top_k_secondary: int = _f(2, "hierarchical: experts per token chosen inside each selected group")
    batchwise_scope: str = _f("local", "batchwise: top-m per expert over this rank's batch, or over the whole "
                                       "data-parallel batch", ("local", "global"))
    threshold_reduction: str = _f("mean", "batchwise: threshold loss as the paper's sum over the batch, or "
                                          "divided by the batch size", ("mean", "sum"))
    moa_aux_weight: float = _f(0.01, "softmax_topk: weight α of the switch-style load-balancing loss")
    moa_z_weight: float = _f(0.001, "softmax_topk: weight β of the router z-loss")
    moa_renormalize: str = _f("none", "softmax_topk: keep the top-k probabilities as they are (released code) or "
                                      "divide by their detached sum (paper eq. 9)", ("none", "detached"))
    dispatch: str = _f("dropless", "token dispatch: every routed copy reaches its expert, or each expert takes at "
                                   "most capacity_factor x its fair share and the lowest-gate copies are dropped",
                       ("dropless", "capacity"))
    capacity_factor: float = _f(1.0, "capacity dispatch: expert capacity = ceil(factor x tokens x k / experts)")
    expert_recompute: bool = _f(False, "recompute the experts' hidden activations in the backward pass instead "
                                       "of storing them (Shazeer et al. App. D)")
    expert_grad_reuse: bool = _f(True, "CPU: write the expert weights' gradients into the memory of the last "
                                       "ones, not onto fresh pages the kernel must zero first (faster; that "
                                       "memory, one gradient per expert weight, stays allocated between steps)")
    layout: str = _f("lstm-moe-lstm", "layer stack between embedding and softmax: App. C.1's model, or a computationally "
                                      "matched baseline: a dense FFN instead of the MoE (MoE-1-Deep), four LSTMs "
                                      "(4xLSTM-512), or one LSTM (LSTM-2048-512)",
                     ("lstm-moe-lstm", "lstm-ffn-lstm", "4xlstm", "lstm"))
    lstm_hidden: int = _f(0, "LSTM units (0: d_model); more than d_model adds an output projection back to d_model "
                             "(Sak et al. 2014)")
    ffn_layers: int = _f(1, "lstm-ffn-lstm: ReLU hidden layers of width expert_hidden in the dense FFN")
    model: str = _f("lstm", "architecture: Shazeer's LSTM-MoE (App. C.1) or a decoder-only transformer LM",
                    ("lstm", "transformer"))
    attention: str = _f("mha", "transformer: attention of every layer: multi-head with head masks, MoA "
                               "attention experts, or MAE (mixture of h-1 heads)", ("mha", "moa", "mae"))
    num_layers: int = _f(2, "transformer: decoder blocks")
    num_heads: int = _f(4, "transformer: heads per attention layer (mha, mae); MoA uses --moa-top-k")
    head_dim: int = _f(0, "transformer: width per head (0: d_model / num_heads)")
    ffn: str = _f("dense", "transformer: feed-forward of every block: dense, or an MoE layer with --gate",
                  ("dense", "moe"))
    ffn_hidden: int = _f(256, "transformer: hidden width of the dense feed-forward")
    moa_num_experts: int = _f(8, "moa: attention experts per layer (E)")
    moa_top_k: int = _f(2, "moa: attention experts per query token (k)")
    mae_g_every: int = _f(5, "mae: G steps (gate only) on one epoch (or step, --mae-g-unit) in every n, each "
                             "before the F step on the same batch (Alg. 3)")
    mae_g_unit: str = _f("epoch", "mae: what --mae-g-every counts", ("epoch", "step"))
    mae_training: str = _f("bcd", "mae: block coordinate descent (G and F steps), or the NoBCD ablation: gate "
                                  "and model trained jointly through the mixture", ("bcd", "joint"))
    mae_gate_lr: float = _f(1.0, "mae: plain-SGD learning rate of the gate in G steps")


@dataclass
class DataConfig:
    data: str = _f("embedded", "training text: 'embedded' (built-in corpus), a file, a directory, or a glob "
                               "of one-sentence-per-line files")
    valid_data: str | None = _f(None, "validation text (default: valid* files beside --data, else held out)")
    test_data: str | None = _f(None, "test text (default: test* files beside --data, else held out)")
    holdout_fraction: float = _f(0.02, "share of training sentences held out for valid+test when none given")
    vocab_size: int = _f(10000, "largest vocabulary, including <UNK>, <S>, </S>")
    min_count: int = _f(1, "drop words seen fewer times than this from the vocabulary")
    seq_len: int = _f(32, "tokens per training window (truncated back-propagation length)")


@dataclass
class TrainConfig:
    batch_size: int = _f(64, "global batch: sequences per optimizer step over all ranks")
    grad_accum: int = _f(1, "micro-batches accumulated per optimizer step")
    max_steps: int = _f(600, "optimizer steps to train")
    lr: float = _f(3e-3, "peak Adam learning rate")
    warmup_steps: int = _f(100, "linear warm-up steps, then lr ∝ 1/sqrt(step) (Shazeer et al. App. C.1)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    seed: int = _f(1234, "seed for initialisation, data order, dropout and gate noise")
    noise_rng: str = _f("rank", "gate noise per rank, or drawn per global token so any world size draws the "
                                "same noise (costs global tokens x experts memory)", ("rank", "global"))
    ep_size: int = _f(1, "expert-parallel ranks: experts are split over groups of this many ranks")
    all_to_all: str = _f("flat", "token exchange: one all-to-all over the expert-parallel group, or within each "
                                 "node first and then across nodes", ("flat", "hierarchical"))
    node_size: int = _f(0, "hierarchical all-to-all: ranks per node (0: the launcher's LOCAL_WORLD_SIZE)")
    ds_config: str | None = _f(None, "DeepSpeed JSON (default: the built-in CPU config, ds_configs/cpu.json)")
    out: str = _f("runs/lstm-moe", "run directory: config, vocab, summary, TensorBoard events, checkpoints")
    resume: bool = _f(False, "continue from the latest complete checkpoint in --out")
    overwrite: bool = _f(False, "replace an existing run in --out")
    log_interval: int = _f(50, "steps between log lines and TensorBoard points")
    eval_interval: int = _f(200, "steps between validation passes (and at the end)")
    eval_max_batches: int = _f(0, "cap on validation batches per pass (0: the whole split)")
    checkpoint_interval: int = _f(200, "steps between checkpoints (and at the end); 0: never (benchmarks: "
                                       "such a run cannot be resumed or evaluated)")
    preset: str | None = _f(None, "start from a paper model's settings (`moe-scale flops --list`; NAME-mini for a "
                                  "CPU-sized miniature); other flags given override them")
    softmax: str = _f("full", "output layer: exact softmax, importance-sampled softmax in training (exact at eval; "
                              "Jozefowicz et al. 2016), or adaptive softmax", ("full", "sampled", "adaptive"))
    num_sampled: int = _f(8192, "sampled softmax: classes drawn per batch (shared by all its tokens)")
    sampler: str = _f("log_uniform", "sampled softmax proposal: Zipfian over frequency-sorted ids, or the "
                                     "training unigram counts", ("log_uniform", "unigram"))
    adaptive_cutoffs: str = _f("2000,10000", "adaptive softmax: comma-separated cluster boundaries (word ids)")
    optimizer: str = _f("adam", "AdamW everywhere, or for expert matrices a factored second moment without first "
                                "moment (Shazeer et al. App. D) and AdamW for the rest", ("adam", "factored"))
    stream: bool = _f(False, "stream the training shards (never loads them into memory; the position is "
                             "checkpointed) instead of loading them")
    shuffle_buffer: int = _f(10000, "streaming: sentences in the shuffle buffer of each reader (0 or 1: no shuffle)")
    stream_workers: int = _f(1, "streaming: shard readers per rank (shards are split over ranks x readers)")
    token_budget: int = _f(0, "streaming: stop after this many training tokens (0: --max-steps); one pass, "
                              "training also stops when the data runs out")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> "RunConfig":
        if not isinstance(raw, dict):
            raise UserError(f"{source}: expected a JSON object with sections model, data, train")
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(raw) - set(sections)
        if unknown:
            raise UserError(f"{source}: unknown section(s) {sorted(unknown)}; allowed: {sorted(sections)}")
        built = {}
        for f in dataclasses.fields(cls):
            section_cls = type(getattr(cls(), f.name))
            values = raw.get(f.name, {})
            names = {sf.name for sf in dataclasses.fields(section_cls)}
            bad = set(values) - names
            if bad:
                raise UserError(f"{source}: unknown key(s) {sorted(bad)} in section '{f.name}'; "
                                f"see `moe-scale train --help` for the valid settings")
            built[f.name] = section_cls(**values)
        return cls(**built)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"--config {path}: no such file; pass a run's config.json or its run directory")
        except json.JSONDecodeError as e:
            raise UserError(f"--config {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})")
        config = cls.from_dict(raw, f"--config {path}")
        config.validate()
        return config

    def validate(self) -> None:
        """Checks that need no data or processes; the trainer checks world-size-dependent ones."""
        m, d, t = self.model, self.data, self.train
        positive = {"--d-model": m.d_model, "--expert-hidden": m.expert_hidden, "--num-experts": m.num_experts,
                    "--top-k": m.top_k, "--seq-len": d.seq_len, "--batch-size": t.batch_size,
                    "--grad-accum": t.grad_accum, "--max-steps": t.max_steps, "--ep-size": t.ep_size,
                    "--log-interval": t.log_interval, "--eval-interval": t.eval_interval,
                    "--min-count": d.min_count}
        for flag, value in positive.items():
            if value < 1:
                raise UserError(f"{flag} must be at least 1 (got {value})")
        if t.checkpoint_interval < 0:
            raise UserError(f"--checkpoint-interval must be 0 (never) or positive (got {t.checkpoint_interval})")
        if m.top_k > m.num_experts:
            raise UserError(f"--top-k {m.top_k} is larger than --num-experts {m.num_experts}; "
                            f"choose k <= number of experts")
        if m.num_experts % t.ep_size:
            raise UserError(f"--num-experts {m.num_experts} is not divisible by --ep-size {t.ep_size}; "
                            f"each expert-parallel rank must hold the same number of experts")
        if m.gate == "hierarchical":
            self._validate_hierarchical()
        if m.lstm_hidden < 0 or m.ffn_layers < 1:
            raise UserError(f"--lstm-hidden must be 0 (= d_model) or positive and --ffn-layers at least 1 "
                            f"(got {m.lstm_hidden}, {m.ffn_layers})")
        if not 0.0 <= m.dropout < 1.0:
            raise UserError(f"--dropout must be in [0, 1) (got {m.dropout})")
        if not 0.0 < d.holdout_fraction < 0.5:
            raise UserError(f"--holdout-fraction must be in (0, 0.5) (got {d.holdout_fraction})")
        if d.vocab_size < 4:
            raise UserError(f"--vocab-size must be at least 4 (3 special symbols and a word); got {d.vocab_size}")
        if min(m.w_importance, m.w_load, t.lr, t.weight_decay, t.warmup_steps, t.eval_max_batches) < 0:
            raise UserError("--w-importance, --w-load, --lr, --weight-decay, --warmup-steps and "
                            "--eval-max-batches must not be negative")
        if m.capacity_factor <= 0:
            raise UserError(f"--capacity-factor must be positive (got {m.capacity_factor}); 1.0 gives each "
                            f"expert exactly its fair share of tokens x k / experts")
        if t.node_size < 0:
            raise UserError(f"--node-size must be 0 (from the launcher) or a positive rank count (got {t.node_size})")
        if t.resume and t.overwrite:
            raise UserError("--resume and --overwrite contradict each other; pass one of them")
        if m.model == "transformer":
            from moe_scale.models.transformer_config import validate_transformer

            validate_transformer(m, t.ep_size)
            if m.attention == "mae" and m.mae_training == "bcd" and m.mae_g_unit == "epoch" and t.stream:
                raise UserError("--mae-g-unit epoch needs epochs, and streamed data (--stream) is one pass; "
                                "pass --mae-g-unit step")
        from moe_scale.train.scale_options import validate_scale_options   # softmax, optimizer, streaming
        validate_scale_options(self)

    def _validate_hierarchical(self) -> None:
        m, ep = self.model, self.train.ep_size
        if m.num_groups < 1 or m.num_experts % m.num_groups:
            raise UserError(f"--num-groups {m.num_groups} must divide --num-experts {m.num_experts} "
                            f"(a groups x b experts = n)")
        per_group = m.num_experts // m.num_groups
        if m.top_k > m.num_groups:
            raise UserError(f"--top-k {m.top_k} (primary k) is larger than --num-groups {m.num_groups}")
        if not 1 <= m.top_k_secondary <= per_group:
            raise UserError(f"--top-k-secondary {m.top_k_secondary} must be between 1 and the {per_group} experts "
                            f"per group")
        if m.num_groups % ep:
            raise UserError(f"--num-groups {m.num_groups} is not divisible by --ep-size {ep}; each group's "
                            f"experts must live on one expert-parallel rank")
