"""The papers' models as named presets, each with a CPU-sized miniature (`NAME-mini`).

    lm1b-*      Shazeer et al. 2017, Table 7 (1B-word benchmark, App. C): 16 K40s, ~300k words per batch
    news100b-*  Shazeer et al. 2017, Table 8 (100B-word Google News, App. D): 32 K40s (64 and 128 for the
                two largest), ~2.5M words per batch, expert recompute, factored Adam (β1 = 0) on experts
    news1t-*    Shazeer et al. 2017 §3.1's goal, a trillion parameters: Table 8's family (App. D) at 2^20 experts
    moa-*       MoA (Zhang et al. 2022) Table 1/3, WMT14 En-De: base 8K8E128D, big 16K32E256D

Each preset carries the paper's published numbers (`PaperRow`) so `moe-scale flops` can print them beside
ours and the tests can check ours against them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moe_scale.config import RunConfig
from moe_scale.errors import UserError
from moe_scale.accounting.flops import SoftmaxCost

LM1B_VOCAB = 793_471      # §5.1
# Not stated for the Google News corpus. Table 8's totals (billions, one decimal) minus its
# parameters-excluding-embedding-and-softmax bound embedding + softmax (2·V·512 + V) to 77–112M, i.e.
# V between 75k and 109k words; we take 100k.
NEWS100B_VOCAB = 100_000
# The importance-sampled softmax of Jozefowicz et al. 2016 (8192 samples), which the paper's training
# FLOPs include. The sample count is not stated in the seed paper; 8192 reproduces MoE-4096-h's 0.74 TFLOPS.
PAPER_SOFTMAX = SoftmaxCost("sampled", 8192)


@dataclass(frozen=True)
class PaperRow:
    ops_per_timestep_M: float | None       # forward MACs per token excluding the softmax (MoA: model MACs)
    params_excl_M: float | None            # parameters excluding embedding and softmax
    total_params_B: float | None
    tflops_per_gpu: float | None = None    # observed


@dataclass(frozen=True)
class Preset:
    name: str
    source: str
    kind: str                              # "lstm" (buildable here) or "moa" (analytic only)
    model: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    softmax: SoftmaxCost = PAPER_SOFTMAX
    paper: PaperRow | None = None
    cluster_gpus: int = 0                  # the paper's cluster
    gpu_mem_gib: float = 12.0              # K40
    batch_words: int = 0                   # words per global batch in the paper
    optimizer: str = "adam"                # expert optimizer: "adam" or "factored" (App. D)
    moa: dict = field(default_factory=dict)  # k, num_experts, d_head for kind "moa"


def _lm1b(name, paper, dropout, cluster=16, **model):
    return Preset(f"lm1b-{name}", "Shazeer et al. 2017, Table 7", "lstm", model={"d_model": 512,
                  "expert_hidden": 1024, "top_k": 4, "dropout": dropout, **model},
                  data={"vocab_size": LM1B_VOCAB}, train={"warmup_steps": 1000}, paper=paper,
                  cluster_gpus=cluster, batch_words=300_000)


def _hier(groups, per_group, **extra):
    return {"gate": "hierarchical", "num_groups": groups, "num_experts": groups * per_group, "top_k": 2,
            "top_k_secondary": 2, **extra}


def _news(name, paper, gpus=32, **model):
    return Preset(f"news100b-{name}", "Shazeer et al. 2017, Table 8", "lstm",
                  model={"d_model": 512, "expert_hidden": 1024, "top_k": 4, "expert_recompute": True,
                         "dropout": 0.1, **model},
                  data={"vocab_size": NEWS100B_VOCAB}, train={"warmup_steps": 1000}, paper=paper,
                  cluster_gpus=gpus, batch_words=2_500_000, optimizer="factored")


def _news1t(groups: int, per_group: int) -> Preset:
    """§3.1: "It is our goal to train a trillion-parameter model on a trillion-word corpus." Table 8's model
    (d 512, experts of 1024 hidden units, hierarchical top-2 of top-2, recompute, factored Adam) at
    groups x per_group experts, with the two-stage (hierarchical) all-to-all a cluster of nodes needs."""
    return Preset(f"news1t-moe-{groups * per_group}-h", "Shazeer et al. 2017 §3.1 (goal; Table 8's family)", "lstm",
                  model={"d_model": 512, "expert_hidden": 1024, "expert_recompute": True, "dropout": 0.1,
                         "all_to_all": "hierarchical", **_hier(groups, per_group)},
                  data={"vocab_size": NEWS100B_VOCAB}, train={"warmup_steps": 1000}, optimizer="factored",
                  gpu_mem_gib=80.0, batch_words=2_500_000)


def _moa(name, k, experts, d_head, paper):
    return Preset(f"moa-{name}", "Zhang et al. 2022 (MoA), Tables 1 and 3", "moa",
                  model={"gate": "softmax_topk", "top_k": k, "num_experts": experts, "d_model": 512},
                  paper=paper, softmax=SoftmaxCost("full"), moa={"k": k, "num_experts": experts, "d_head": d_head})


_PRESETS = [
    _lm1b("4xlstm-512", PaperRow(8.4, 8.4, 0.8, 1.07), 0.1, layout="4xlstm"),
    _lm1b("lstm-2048-512", PaperRow(9.4, 9.4, 0.8, 1.21), 0.1, layout="lstm", lstm_hidden=2048),
    _lm1b("moe-1-wide", PaperRow(8.4, 8.4, 0.8, 1.29), 0.1, num_experts=1, top_k=1, expert_hidden=4096),
    _lm1b("moe-1-deep", PaperRow(8.4, 8.4, 0.8, 1.29), 0.1, layout="lstm-ffn-lstm", ffn_layers=4),
    _lm1b("moe-4", PaperRow(8.4, 8.4, 0.8, 0.52), 0.1, num_experts=4),
    _lm1b("moe-32", PaperRow(8.4, 37.8, 0.9, 0.87), 0.1, num_experts=32),
    _lm1b("moe-256", PaperRow(8.6, 272.9, 1.1, 0.81), 0.1, num_experts=256),
    _lm1b("moe-256-h", PaperRow(8.4, 272.9, 1.1, 0.89), 0.1, **_hier(16, 16)),
    _lm1b("moe-1024-h", PaperRow(8.5, 1079.0, 1.9, 0.90), 0.2, **_hier(16, 64)),
    _lm1b("moe-4096-h", PaperRow(8.9, 4303.4, 5.1, 0.74), 0.2, **_hier(16, 256)),
    _lm1b("moe-34m", PaperRow(33.8, 4313.9, 6.0, 1.22), 0.3, d_model=1024, expert_hidden=2048, **_hier(16, 64)),
    _lm1b("moe-143m", PaperRow(142.7, 4371.1, 6.0, 1.56), 0.4, d_model=1024, lstm_hidden=4096,
          expert_hidden=8192, **_hier(16, 16)),
    _news("4xlstm-512", PaperRow(8.4, 8.4, 0.1, 1.23), layout="4xlstm"),
    _news("moe-32", PaperRow(8.4, 37.8, 0.1, 0.83), num_experts=32),
    _news("moe-256-h", PaperRow(8.4, 272.9, 0.4, 1.11), **_hier(32, 8)),
    _news("moe-1024-h", PaperRow(8.5, 1079.0, 1.2, 1.14), **_hier(32, 32)),
    _news("moe-4096-h", PaperRow(8.6, 4303.4, 4.4, 1.07), **_hier(64, 64)),
    _news("moe-16384-h", PaperRow(8.8, 17201.0, 17.3, 0.96), **_hier(128, 128)),
    _news("moe-65536-h", PaperRow(9.2, 68791.0, 68.9, 0.72), gpus=64, **_hier(256, 256)),
    _news("moe-131072-h", PaperRow(9.7, 137577.6, 137.7, 0.30), gpus=128, **_hier(256, 512)),
    _news1t(1024, 1024),
    _moa("base", 8, 8, 128, PaperRow(628.0, None, 0.065)),
    _moa("big", 16, 32, 256, PaperRow(1220.0, None, 0.200)),
]

# CPU-sized miniatures: same layout, gate and k; every width and count shrunk to run in seconds here.
MINI_D_MODEL = 32
MINI_SETTINGS = {"data": {"vocab_size": 2000, "seq_len": 16},
                 "train": {"batch_size": 16, "max_steps": 40, "warmup_steps": 10, "log_interval": 10,
                           "eval_interval": 40, "eval_max_batches": 4, "checkpoint_interval": 40}}


def _miniature(preset: Preset) -> Preset:
    m = dict(preset.model)
    scale = MINI_D_MODEL / m["d_model"]
    m["d_model"] = MINI_D_MODEL
    m["expert_hidden"] = max(8, int(m.get("expert_hidden", 1024) * scale) // 2)
    if m.get("lstm_hidden"):
        m["lstm_hidden"] = 2 * MINI_D_MODEL
    if m.get("gate") == "hierarchical":
        groups = min(m["num_groups"], 4)
        m.update(num_groups=groups, num_experts=groups * min(m["num_experts"] // m["num_groups"], 4))
    elif "num_experts" in m:
        m["num_experts"] = min(m["num_experts"], 16)
    moa = dict(preset.moa)
    if moa:
        moa.update(d_head=max(4, moa["d_head"] // 16))
    return dataclasses.replace(preset, name=preset.name + "-mini", source=preset.source + " (CPU miniature)",
                               model=m, data=MINI_SETTINGS["data"], train=MINI_SETTINGS["train"], paper=None,
                               softmax=SoftmaxCost("full"), cluster_gpus=0, batch_words=0, moa=moa)


PRESETS: dict[str, Preset] = {p.name: p for base in _PRESETS for p in (base, _miniature(base))}


def get_preset(name: str) -> Preset:
    preset = PRESETS.get(name.lower())
    if preset is None:
        close = [n for n in PRESETS if name.lower() in n][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UserError(f"--preset {name}: unknown preset{hint}; `moe-scale flops --list` lists all "
                        f"{len(PRESETS)} presets")
    return preset


def preset_config(name: str) -> RunConfig:
    """A RunConfig with the preset's settings on top of the defaults."""
    config = RunConfig()
    apply_preset(config, name)
    return config


def apply_preset(config: RunConfig, name: str) -> None:
    """The preset's settings (by key, as flags name them) on top of `config`."""
    preset = get_preset(name)
    require_trainable(preset)
    for values in (preset.model, preset.data, preset.train):
        for key, value in values.items():
            config.set(key, value)
    if preset.softmax.kind == "sampled":   # the paper trains with it, and `flops` counts it
        config.set("softmax", "sampled")
        config.set("num_sampled", preset.softmax.num_samples)
    config.train.preset = preset.name


def require_trainable(preset: Preset) -> None:
    if preset.kind != "lstm":
        raise UserError(f"--preset {preset.name}: MoA presets need the transformer LM, which this build does not "
                        f"have yet; use `moe-scale flops --preset {preset.name}` for its analytic counts")
