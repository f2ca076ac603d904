"""Analytic parameter and FLOP counts, by Shazeer et al.'s rule (§5.1, App. C, D) and MoA's eq. 18–20.

Definitions (the paper's, read so that every row of Tables 7 and 8 reproduces):

- ops/timestep = forward multiply-adds (MACs) per token, softmax and embedding excluded, both gating
  matrices (W_g and W_noise) included, active experts only (and the shared experts, which every token runs).
  At a hierarchical MoE the primary gate (2·d·a) plus the secondary gates of the k_p chosen groups (k_p·2·d·b)
  are counted: a token never evaluates the secondary gates of groups it did not choose (MoE-4096-h:
  2·512·16 + 2·2·512·256 + 2 LSTMs + 4 experts = 8.93M, printed 8.9; counting all 16 secondary gates would
  give 12.6M).
- An LSTM(in, h) costs 4h(in + r) MACs with r = h, or r = p with an output projection to p, which adds h·p
  (Sak et al. 2014); its parameters add the 4h gate biases (the paper's single bias; torch keeps two).
- Training FLOPs per token = 3 (forward + backward ≈ 2 x forward) x 2 (a multiply-add is 2 FLOPs) x
  (ops/timestep + the softmax's forward MACs), the softmax counted for its kind: full (d·V) or sampled
  (d·(S + 1): S shared samples plus the true class, as in an importance-sampled softmax).
- TFLOPS per device = FLOPs of the global batch / (step time x world size).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_scale.config import RunConfig

SOFTMAX_KINDS = ("full", "sampled")


@dataclass(frozen=True)
class SoftmaxCost:
    kind: str = "full"          # "full" or "sampled"
    num_samples: int = 0        # sampled: classes drawn per batch (shared by all its tokens)

    def forward_macs(self, d_model: int, vocab_size: int) -> int:
        if self.kind == "full":
            return d_model * vocab_size
        if self.kind == "sampled":
            return d_model * (min(self.num_samples, vocab_size) + 1)
        raise ValueError(f"unknown softmax kind {self.kind!r}; choose from {SOFTMAX_KINDS}")


@dataclass
class Accounting:
    """Per-token counts of one model, by component. Parameters are global (all experts)."""

    params: dict[str, int]          # includes "embedding" and "softmax"
    forward_macs: dict[str, int]    # excludes the softmax (that is `softmax_macs`)
    softmax_macs: int

    @property
    def total_params(self) -> int:
        return sum(self.params.values())

    @property
    def params_excluding_embedding_softmax(self) -> int:
        return sum(v for k, v in self.params.items() if k not in ("embedding", "softmax"))

    @property
    def ops_per_timestep(self) -> int:
        return sum(self.forward_macs.values())

    @property
    def training_flops_per_token(self) -> int:
        return 6 * (self.ops_per_timestep + self.softmax_macs)

    def as_dict(self) -> dict:
        return {"total_params": self.total_params,
                "params_excluding_embedding_softmax": self.params_excluding_embedding_softmax,
                "ops_per_timestep": self.ops_per_timestep, "softmax_forward_macs": self.softmax_macs,
                "training_flops_per_token": self.training_flops_per_token,
                "params_by_part": dict(self.params), "forward_macs_by_part": dict(self.forward_macs)}


def lstm_macs(d_in: int, d_hidden: int, proj: int = 0) -> int:
    recurrent = proj or d_hidden
    return 4 * d_hidden * (d_in + recurrent) + d_hidden * proj


def lstm_params(d_in: int, d_hidden: int, proj: int = 0) -> int:
    return lstm_macs(d_in, d_hidden, proj) + 4 * d_hidden


def ffn_macs(d_model: int, d_hidden: int, hidden_layers: int = 1) -> int:
    """d -> h (-> h ...) -> d without biases; also its parameter count."""
    return 2 * d_model * d_hidden + (hidden_layers - 1) * d_hidden * d_hidden


def lstm_layer_shape(config: RunConfig) -> tuple[int, int]:
    """(units, projection) of every LSTM of the model: wider than d_model means projected back to d_model."""
    d = config.model.d_model
    units = config.model.lstm.hidden or d
    return units, (d if units != d else 0)


def moe_gating(config: RunConfig) -> tuple[int, int]:
    """(parameters, forward MACs) of the gating network, as its gate counts them (moe/router/)."""
    from moe_scale.moe.router.build import gate_class   # (torch: not at `moe-scale flops`' start)

    router = config.moe.router
    return gate_class(router).gating_counts(router, config.model.d_model, config.moe.experts.num_experts)


def shared_experts(config: RunConfig) -> int:
    """Parameters of one MoE layer's shared experts, also their forward MACs per token: S FFNs d -> h_s -> d of the
    experts' kind (a gated kind's: three matrices, gate, up and down) and, with --shared-expert-gate, the gate's d (0
    without shared experts)."""
    experts, d = config.moe.experts, config.model.d_model
    if not experts.shared:
        return 0
    per_expert = expert_macs(config, experts.shared_hidden or experts.hidden)
    return experts.shared * per_expert + (d if experts.shared_gate else 0)


def expert_macs(config: RunConfig, hidden: int) -> int:
    """Forward multiply-adds of one token through one expert of the run's kind (moe/experts/kinds.py), also its
    parameter count (no biases)."""
    from moe_scale.moe.experts.kinds import expert_kind

    return expert_kind(config.expert_kind).forward_macs(config.model.d_model, hidden)


def active_experts(config: RunConfig) -> int:
    from moe_scale.moe.router.build import gate_class

    return gate_class(config.moe.router).active_experts(config.moe.router)


def lstm_lm_accounting(config: RunConfig, vocab_size: int, softmax: SoftmaxCost = SoftmaxCost()) -> Accounting:
    """Counts for LSTMMoELM under each `--layout` (App. C.1 model and the computationally matched baselines)."""
    d, lstm, experts = config.model.d_model, config.model.lstm, config.moe.experts
    units, proj = lstm_layer_shape(config)
    n_lstm = {"lstm-moe-lstm": 2, "lstm-ffn-lstm": 2, "4xlstm": 4, "lstm": 1}[lstm.layout]
    params = {"embedding": vocab_size * d, "lstm": n_lstm * lstm_params(d, units, proj),
              "softmax": vocab_size * d + vocab_size}
    macs = {"lstm": n_lstm * lstm_macs(d, units, proj)}
    if lstm.layout == "lstm-moe-lstm":
        gate_params, gate_macs = moe_gating(config)
        params.update(gating=gate_params, experts=experts.num_experts * expert_macs(config, experts.hidden))
        macs.update(gating=gate_macs, experts=active_experts(config) * expert_macs(config, experts.hidden))
        if experts.shared:   # dense, always active: every token runs them all
            params["shared_experts"] = macs["shared_experts"] = shared_experts(config)
    elif lstm.layout == "lstm-ffn-lstm":
        params["ffn"] = macs["ffn"] = ffn_macs(d, experts.hidden, lstm.ffn_layers)
    return Accounting(params, macs, softmax.forward_macs(d, vocab_size))


def lstm_moe_forward_macs_per_token(config: RunConfig, vocab_size: int) -> dict[str, int]:
    """Forward MACs per token of the LSTM LM by component, with a full softmax (the model's own)."""
    counts = lstm_lm_accounting(config, vocab_size)
    return {**counts.forward_macs, "softmax": counts.softmax_macs}


def training_flops_per_token(forward_macs: dict[str, int]) -> int:
    return 3 * 2 * sum(forward_macs.values())


def tflops_per_device(flops_per_step: float, step_seconds: float, world_size: int) -> float:
    return flops_per_step / (step_seconds * world_size) / 1e12


# ---- MoA (Zhang et al. 2022), eq. 18–20 -------------------------------------------------------------------
# The transformer LM that will use MoA is built elsewhere; these are the paper's formulas, the functions a
# built model's counts are to be checked against.

def moa_layer_macs(seq_len: int, k: int, d_head: int, d_model: int) -> int:
    """eq. 18: C_MoA = k·T²·d_h + 2(k+1)·T·d_h·d_m (one T² term; the router is not counted)."""
    return k * seq_len ** 2 * d_head + 2 * (k + 1) * seq_len * d_head * d_model


def mha_layer_macs(seq_len: int, d_model: int) -> int:
    """eq. 19: C_MHA = T²·d_m + 4·T·d_m²."""
    return seq_len ** 2 * d_model + 4 * seq_len * d_model ** 2


def moa_layer_params(num_experts: int, d_head: int, d_model: int) -> int:
    """eq. 20: M_MoA = (2E + 2)·d_h·d_m (per-expert W_q, W_o; shared W_k, W_v; no biases, no router)."""
    return (2 * num_experts + 2) * d_head * d_model


@dataclass(frozen=True)
class MoATransformer:
    """A Transformer whose attention modules are all replaced by MoA (Table 1/3 setting).

    The rest of the network is taken from the MHA Transformer the paper starts from: its MACs and
    parameters as the paper reports them (Transformer-base on WMT14 En-De: 604M MACs measured with ptflops
    at T_src = T_tgt = 10, batch 1; 65M parameters for the MoA base model it was derived from), with the
    attention part of eq. 19/20 swapped for eq. 18/20 plus the router (d_m·E per module).
    """

    k: int
    num_experts: int
    d_head: int
    d_model: int = 512
    attention_modules: int = 18          # 6 encoder self, 6 decoder self, 6 cross
    seq_len: int = 10
    transformer_macs: int = 604_000_000  # Table 1, Transformer base
    base_params: int = 65_000_000        # Table 3, MoA base (8K8E128D): the non-attention rest is derived from it

    def macs(self) -> int:
        swap = moa_layer_macs(self.seq_len, self.k, self.d_head, self.d_model) - mha_layer_macs(self.seq_len,
                                                                                                self.d_model)
        return self.transformer_macs + self.attention_modules * swap

    def attention_params(self, num_experts: int, d_head: int) -> int:
        return self.attention_modules * (moa_layer_params(num_experts, d_head, self.d_model)
                                         + self.d_model * num_experts)

    def params(self) -> int:
        rest = self.base_params - self.attention_params(8, 128)
        return rest + self.attention_params(self.num_experts, self.d_head)
