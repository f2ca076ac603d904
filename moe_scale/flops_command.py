"""`moe-scale flops --preset NAME [--json]`: parameters, ops/timestep and training FLOPs of a preset.

LSTM presets are built on the meta device (no memory, so MoE-131072-h's 137.7B parameters cost nothing)
and their parameters counted from the module; the analytic counts of metrics/flops.py are printed beside
them, with the paper's numbers. MoA presets are analytic (eq. 18–20).
"""

from __future__ import annotations

import json

from moe_scale.metrics.flops import MoATransformer, SoftmaxCost, lstm_lm_accounting
from moe_scale.models.meta_build import build_lstm_lm_on_meta, parameter_counts
from moe_scale.errors import UserError
from moe_scale.presets import PRESETS, get_preset, preset_config


def flops_report(name: str, softmax: SoftmaxCost | None = None) -> dict:
    preset = get_preset(name)
    softmax = softmax or preset.softmax
    paper = preset.paper
    report = {"preset": preset.name, "source": preset.source,
              "softmax": {"kind": softmax.kind, "num_samples": softmax.num_samples}}
    if preset.kind == "moa":
        moa = MoATransformer(**preset.moa)
        report.update(total_params=moa.params(), macs_per_sentence_pair=moa.macs(),
                      note="analytic (MoA eq. 18-20 on Transformer-base, T_src = T_tgt = 10, batch 1)",
                      paper={"macs_M": paper.ops_per_timestep_M, "params_M": paper.total_params_B * 1e3}
                      if paper else None)
        return report
    config = preset_config(preset.name)
    vocab = config.data.vocab_size
    counts = parameter_counts(build_lstm_lm_on_meta(config.model, vocab))
    total = sum(counts.values())
    analytic = lstm_lm_accounting(config.model, vocab, softmax)
    # The paper's convention counts one LSTM bias vector; torch's module has two (4h more per LSTM).
    report.update(
        vocab_size=vocab,
        total_params=analytic.total_params,
        params_excluding_embedding_softmax=analytic.params_excluding_embedding_softmax,
        module_total_params=total,
        module_params_excluding_embedding_softmax=total - counts["embedding"] - counts["softmax"],
        ops_per_timestep=analytic.ops_per_timestep,
        training_flops_per_token=analytic.training_flops_per_token,
        analytic=analytic.as_dict(),
        paper=dataclass_dict(paper))
    return report


def dataclass_dict(row) -> dict | None:
    return None if row is None else {k: getattr(row, k) for k in row.__dataclass_fields__}


def format_report(report: dict) -> str:
    paper = report.get("paper") or {}
    lines = [f"{report['preset']}  ({report['source']})"]
    if "macs_per_sentence_pair" in report:
        lines += [f"  total parameters          {report['total_params'] / 1e6:12.1f}M   paper {paper.get('params_M')}M",
                  f"  MACs (T=10, batch 1)      {report['macs_per_sentence_pair'] / 1e6:12.1f}M   "
                  f"paper {paper.get('macs_M')}M",
                  f"  {report['note']}"]
        return "\n".join(lines)
    softmax = report["softmax"]
    kind = softmax["kind"] + (f", {softmax['num_samples']} samples" if softmax["kind"] == "sampled" else "")
    lines += [
        f"  total parameters          {report['total_params'] / 1e9:12.3f}B   paper {paper.get('total_params_B')}B",
        f"  params excl. emb.+softmax {report['params_excluding_embedding_softmax'] / 1e6:12.2f}M   "
        f"paper {paper.get('params_excl_M')}M",
        f"  the module (built on meta) {report['module_params_excluding_embedding_softmax'] / 1e6:11.2f}M   "
        f"(torch's LSTMs keep two bias vectors)",
        f"  ops/timestep (fwd MACs)   {report['ops_per_timestep'] / 1e6:12.2f}M   "
        f"paper {paper.get('ops_per_timestep_M')}M",
        f"  training FLOPs per token  {report['training_flops_per_token'] / 1e6:12.2f}M   (softmax: {kind})",
    ]
    return "\n".join(lines)


def list_presets() -> str:
    return "\n".join(f"{p.name:<28} {p.source}" for p in PRESETS.values())


def run_flops(name: str | None, as_json: bool, softmax_kind: str | None, samples: int, list_only: bool) -> str:
    if list_only:
        return list_presets()
    if not name:
        raise UserError("flops needs --preset NAME (or --list to see the presets)")
    softmax = None
    if softmax_kind:
        if softmax_kind == "sampled" and samples < 1:
            raise UserError("--softmax sampled needs --softmax-samples N (N >= 1)")
        softmax = SoftmaxCost(softmax_kind, samples)
    report = flops_report(name, softmax)
    return json.dumps(report) if as_json else format_report(report)

