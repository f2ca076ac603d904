"""What the planner needs to know about a model, from the model itself: built on the meta device (no memory, any
size), so its parameter counts are the module's, exactly.

- parameters: dense ones (replicated on every rank), those split over the expert-parallel ranks (every
  `expert_shards()` tensor: the experts, the hierarchical gate's secondary matrices, MoA's attention experts), and
  the vocabulary tables (split by rows over all ranks with --vocab-exchange rows: models/vocab_parallel.py),
  and the factored optimizer's state for the latter (a row and a column vector per matrix, exactly as
  train/factored_optimizer.py keeps it);
- FLOPs per token: `moe-scale train`'s own rule (6 x forward MACs, the softmax as built; accounting/flops.py),
  so predicted TFLOPS/GPU compare one to one with what a run reports; recompute adds the experts' first product;
  the same MACs in groups of one product shape each (accounting/kernels.py: narrow products run slower);
- per expert-parallel layer, what travels: the units tokens are sent to (experts; the hierarchical gate's
  groups), how many a token picks, the pairs per token that arrive and the active experts per token;
- activation values stored per token for the backward pass outside the experts (the experts' side, which
  depends on the routing, is the memory model's dispatch buffers; accounting/memory.py).

Activation values per token (stored for the backward, in the training dtype; 1-byte dropout masks apart). LSTM LM:
the embedding output d; per LSTM of u units its four gates, cell, tanh(cell) and hidden (7u, + d for a projection
back to d); per MoE layer the gate logits (one per gating column a token evaluates) and the sigmoid (d), and the
shared experts' hidden layer and output (S·h_s + d; SwiGLU: 3·S·h_s + d); the dense FFN's hidden layers; the softmax
logits (V, or S + 1 sampled; the adaptive softmax's per-token MACs / d); per layer output d and its mask.
Transformer, per block: two LayerNorms (input and output, 2d each), q, k, v and the context (4w, w = heads x head
width), the attention probabilities (heads x T: the math attention CPUs run; flash attention keeps none, so this is
an upper bound on GPUs), the dense FFN's pre- and post-GELU hidden (2f; the llama block's SwiGLU: gate, up and their
product, 3f) or the MoE gate logits, two sub-layer outputs d with their masks; MoA's k expert queries and contexts
(2k·w_e), its shared K, V (2w_e) and k x T probabilities.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch

from moe_scale.accounting.flops import active_experts, moe_gating, training_flops_per_token
from moe_scale.accounting.kernels import Gemms, gemm_groups
from moe_scale.accounting.model_flops import forward_macs_per_token
from moe_scale.accounting.vocab_exchange import rows_split
from moe_scale.config import RunConfig


@dataclass(frozen=True)
class ExpertLayer:
    """One expert-parallel layer (an MoE feed-forward, or MoA attention): what its exchange moves."""

    kind: str              # "moe" or "moa"
    units: int             # what tokens are sent to: experts, or the hierarchical gate's groups
    picks: int             # units a token picks (a token sends one row per distinct rank among them)
    active: int            # experts that compute per token (hierarchical: primary k x secondary k)
    hidden: int            # an expert's hidden width (MoA: the head width)
    kv_width: int = 0      # MoA: K and V values per token gathered over the expert-parallel group
    shards: int = 1        # --etp-size: each unit's hidden units over this many ranks (a pair per shard; the
                           # layout's: sharded())

    def distinct_ranks(self, ranks: int) -> float:
        """Expected ranks a token sends a row to, its `picks` units drawn without replacement from `units`
        spread evenly over `ranks` / shards expert-parallel ranks (balanced routing): P (1 - C(n - n/P, k) /
        C(n, k)), times the shards (each picked unit's shards live on that many ranks)."""
        ep_size = ranks // self.shards
        if ep_size == 1:
            return float(self.shards)
        n, per_rank, k = self.units, self.units // ep_size, self.picks
        return self.shards * ep_size * (1 - math.comb(n - per_rank, k) / math.comb(n, k))


@dataclass(frozen=True)
class PlannedModel:
    config: RunConfig
    vocab: int
    dense_params: int                 # replicated on every rank
    sharded_params: int               # split over the expert-parallel ranks (all ranks together)
    vocab_params: int                 # the vocabulary tables: split by rows over all ranks with --vocab-exchange rows
    factored_state: int               # the factored optimizer's numbers for the sharded parameters (all ranks)
    expert_layers: tuple[ExpertLayer, ...]
    flops_per_token: int              # training FLOPs per token (train's rule)
    recompute_flops_per_token: int    # what --expert-recompute adds (the layout says whether it is on)
    activation_values_per_token: float
    masks_per_token: int              # 1-byte dropout masks per token
    gemms: tuple[Gemms, ...] = ()     # the forward MACs per token by product shape (accounting/kernels.py)
    copied_params: int = 0            # of sharded_params, what --etp-size copies on each shard's rank, not splits
                                      # (the hierarchical gate's secondary matrices)

    @property
    def total_params(self) -> int:
        return self.dense_params + self.sharded_params + self.vocab_params

    def vocab_split(self, world: int) -> bool:
        return rows_split(self.config, world)

    def params_per_gpu(self, expert_ranks: int, world: int, etp_size: int = 1) -> float:
        """The parameters one rank holds: the dense ones, its experts, the vocabulary tables or its rows of them."""
        tables = self.vocab_params / world if self.vocab_split(world) else self.vocab_params
        return self.dense_params + self.sharded_per_rank(expert_ranks, etp_size) + tables

    def sharded_per_rank(self, expert_ranks: int, etp_size: int = 1) -> float:
        """The sharded parameters one rank holds: its share of the experts, split over the expert_ranks ranks
        (--ep-size x --etp-size), and of what --etp-size copies, split over the --ep-size ranks only."""
        return (self.sharded_params + (etp_size - 1) * self.copied_params) / expert_ranks

    @property
    def sharded_units(self) -> list[int]:
        return [layer.units for layer in self.expert_layers]


def planned_model(config: RunConfig) -> PlannedModel:
    """Build `config`'s model on the meta device (one expert-parallel rank holding every expert) and count."""
    from moe_scale.models.build import build_model
    from moe_scale.models.vocab_parallel import row_split_tables

    vocab = config.data.vocab_size
    counts = [1] * vocab if config.softmax.kind == "sampled" and config.softmax.sampler == "unigram" else None
    whole = copy.deepcopy(config)   # (whole experts: --etp-size is the layout's, planned in step_time and memory)
    whole.moe.experts.tensor_parallel = 1
    with torch.device("meta"):
        model = build_model(whole, vocab, ep_size=1, ep_rank=0, counts=counts)
    shards = [shard.param for layer in model.moe_layers() for shard in layer.expert_shards().values()]
    sharded = sum(p.numel() for p in shards)
    copied = sum(p.numel() for layer in model.moe_layers() for p in layer.shard_copies())
    tables = sum(p.numel() for p in row_split_tables(model))
    softmax_macs = model.softmax.forward_macs_per_token()
    macs = {**forward_macs_per_token(config, vocab, config.data.seq_len), "softmax": softmax_macs}
    layers = _expert_layers(config)
    recompute = sum(2 * layer.active * config.model.d_model * layer.hidden for layer in layers if layer.kind == "moe")
    values, masks = _activations_per_token(config, softmax_macs / config.model.d_model)
    return PlannedModel(config, vocab, sum(p.numel() for p in model.parameters()) - sharded - tables, sharded, tables,
                        sum(factored_state_numel(p.shape) for p in shards), tuple(layers),
                        training_flops_per_token(macs), recompute, values, masks, gemm_groups(config, macs), copied)


def factored_state_numel(shape: torch.Size) -> int:
    """Numbers train/factored_optimizer.py keeps for one tensor of a factored group: row and column averages of
    each matrix (the last two dims) for 2 or more dims, a full second moment for 1-D tensors."""
    if len(shape) < 2:
        return math.prod(shape)
    return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]


def sharded(layers: list[ExpertLayer], etp_size: int) -> list[ExpertLayer]:
    """The MoE feed-forward layers split into `etp_size` shards each (--etp-size; MoA's are never split)."""
    return [dataclasses.replace(layer, shards=etp_size) if layer.kind == "moe" else layer for layer in layers]


def _expert_layers(config: RunConfig) -> list[ExpertLayer]:
    from moe_scale.moe.router.build import gate_class   # the model's modules: when a model is planned, not at import

    layers = []
    if config.has_moe_ffn:
        router, experts = config.moe.router, config.moe.experts
        units = gate_class(router).dispatch_units(router, experts.num_experts)
        n = config.model.transformer.num_layers if config.model.kind == "transformer" else 1
        layers += [ExpertLayer("moe", units, router.top_k, active_experts(config), experts.hidden)] * n
    if config.model.kind == "transformer" and config.attention.kind == "moa":
        moa, width = config.attention.moa, config.attention.head_width(config.model.d_model)
        layers += [ExpertLayer("moa", moa.num_experts, moa.top_k, moa.top_k, width, 2 * width)] \
            * config.model.transformer.num_layers
    return layers


def _activations_per_token(config: RunConfig, logits: float) -> tuple[float, int]:
    """(values, 1-byte masks) stored per token outside the experts (module docstring)."""
    from moe_scale.models.blocks import block_kind
    from moe_scale.moe.experts.kinds import expert_kind

    d = config.model.d_model
    gate_logits = moe_gating(config)[1] / d if config.has_moe_ffn else 0
    experts = config.moe.experts
    hidden_values = expert_kind(config.expert_kind).stored_per_hidden()   # a gated kind: gate, up, their product
    if config.has_moe_ffn and experts.shared:   # the shared experts' hidden layer and output (and the gate's scale)
        gate_logits += hidden_values * experts.shared * (experts.shared_hidden or experts.hidden) + d \
            + int(experts.shared_gate)
    if config.model.kind == "transformer":
        attention, blocks = config.attention, config.model.transformer
        T, w_e = config.data.seq_len, attention.head_width(d)
        if attention.kind == "moa":
            k = attention.moa.top_k
            attend = 4 * k * w_e + 2 * w_e + k * T + attention.moa.num_experts    # + MoA's router logits
        else:
            width = attention.num_heads * w_e
            attend = 4 * width + attention.num_heads * T
        # the dense FFN keeps a value per hidden unit of each matrix but the last, and their product if gated
        ffn = block_kind(config).dense_ffn_matrices * blocks.ffn_hidden if blocks.ffn == "dense" else gate_logits
        per_block = 4 * d + attend + ffn + 2 * d
        return d + blocks.num_layers * per_block + 2 * d + logits, (1 + 2 * blocks.num_layers) * d
    lstm = config.model.lstm
    units = lstm.hidden or d
    n_lstm = {"lstm-moe-lstm": 2, "lstm-ffn-lstm": 2, "4xlstm": 4, "lstm": 1}[lstm.layout]
    values = d + n_lstm * (7 * units + (d if units != d else 0))
    outputs = 1 + n_lstm
    if lstm.layout == "lstm-moe-lstm":
        values, outputs = values + gate_logits + d, outputs + 1
    elif lstm.layout == "lstm-ffn-lstm":
        values, outputs = values + lstm.ffn_layers * config.moe.experts.hidden + d, outputs + 1
    return values + logits + (outputs - 1) * d, outputs * d
