"""`moe-scale flops --preset NAME [--json]`: parameters, ops/timestep and training FLOPs of a preset.

LSTM presets are built on the meta device (no memory, so MoE-131072-h's 137.7B parameters cost nothing)
and their parameters counted from the module; the analytic counts of accounting/flops.py are printed beside
them, with the paper's numbers. MoA presets are analytic (eq. 18–20).
"""

from __future__ import annotations

import argparse
import json

from moe_scale.accounting.flops import (SOFTMAX_KINDS, MoATransformer, SoftmaxCost, lstm_lm_accounting,
                                     moa_layer_macs, moa_layer_params)
from moe_scale.commands.help_format import HelpFormatter
from moe_scale.models.meta_build import build_lstm_lm_on_meta, parameters_per_child
from moe_scale.errors import UserError
from moe_scale.accounting.presets import PRESETS, get_preset, preset_config


def add_parser(sub) -> None:
    p = sub.add_parser("flops", help="parameters, ops/timestep and training FLOPs of a paper preset",
                       description="Parameters, ops per timestep and training FLOPs per token of a paper's model "
                                   "(Shazeer et al. 2017's LSTM-MoE presets, counted from the module built on "
                                   "the meta device; MoA's transformers), beside the paper's numbers.",
                       formatter_class=HelpFormatter)
    p.add_argument("--preset", help="preset name (see --list)")
    p.add_argument("--list", action="store_true", help="list the presets")
    p.add_argument("--softmax", choices=SOFTMAX_KINDS, help="count this softmax instead of the preset's")
    p.add_argument("--softmax-samples", type=int, default=0, help="samples of a sampled softmax")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run_command=run, computes=False)   # (counts and models: its threads go unsaid)


def run(args: argparse.Namespace) -> None:
    print(run_flops(args.preset, args.json, args.softmax, args.softmax_samples, args.list))


def flops_report(name: str, softmax: SoftmaxCost | None = None) -> dict:
    preset = get_preset(name)
    softmax = softmax or preset.softmax
    paper = preset.paper
    report = {"preset": preset.name, "source": preset.source,
              "softmax": {"kind": softmax.kind, "num_samples": softmax.num_samples}}
    if preset.kind == "moa" and paper is None:     # a miniature: per attention module at its own width
        d_model, k, experts, d_head = preset.model["d_model"], preset.moa["k"], preset.moa["num_experts"], \
            preset.moa["d_head"]
        report.update(moa_layer_macs_T10=moa_layer_macs(10, k, d_head, d_model),
                      moa_layer_params=moa_layer_params(experts, d_head, d_model) + d_model * experts,
                      note=f"analytic, one MoA module (eq. 18, 20 + router) at d_model={d_model}, T=10")
        return report
    if preset.kind == "moa":
        moa = MoATransformer(**preset.moa)
        report.update(total_params=moa.params(), macs_per_sentence_pair=moa.macs(),
                      note="analytic (MoA eq. 18-20 on Transformer-base, T_src = T_tgt = 10, batch 1)",
                      paper={"macs_M": paper.ops_per_timestep_M, "params_M": paper.total_params_B * 1e3})
        return report
    config = preset_config(preset.name)
    vocab = config.data.vocab_size
    counts = parameters_per_child(build_lstm_lm_on_meta(config, vocab))
    total = sum(counts.values())
    analytic = lstm_lm_accounting(config, vocab, softmax)
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


def _count(value: float, unit: str = "") -> str:
    if unit == "M" or (not unit and 1e5 <= value < 1e9):
        return f"{value / 1e6:.2f}M"
    return f"{value / 1e9:.3f}B" if value >= 1e9 else f"{value:,.0f}"


def _paper(value, unit: str) -> str:
    return f"paper {value}{unit}" if value is not None else ""


def format_report(report: dict) -> str:
    paper = report.get("paper") or {}
    lines = [f"{report['preset']}  ({report['source']})"]
    if "moa_layer_macs_T10" in report:
        lines += [f"  MoA module MACs (T=10)    {_count(report['moa_layer_macs_T10']):>12}",
                  f"  MoA module parameters     {_count(report['moa_layer_params']):>12}", f"  {report['note']}"]
        return "\n".join(lines)
    if "macs_per_sentence_pair" in report:
        lines += [f"  total parameters          {_count(report['total_params']):>12}   "
                  f"{_paper(paper.get('params_M'), 'M')}",
                  f"  MACs (T=10, batch 1)      {_count(report['macs_per_sentence_pair']):>12}   "
                  f"{_paper(paper.get('macs_M'), 'M')}",
                  f"  {report['note']}"]
        return "\n".join(lines)
    softmax = report["softmax"]
    kind = softmax["kind"] + (f", {softmax['num_samples']} samples" if softmax["kind"] == "sampled" else "")
    lines += [
        f"  total parameters          {_count(report['total_params']):>12}   "
        f"{_paper(paper.get('total_params_B'), 'B')}",
        f"  params excl. emb.+softmax {_count(report['params_excluding_embedding_softmax'], 'M'):>12}   "
        f"{_paper(paper.get('params_excl_M'), 'M')}",
        f"  the module (built on meta) {_count(report['module_params_excluding_embedding_softmax'], 'M'):>11}   "
        f"(torch's LSTMs keep two bias vectors)",
        f"  ops/timestep (fwd MACs)   {_count(report['ops_per_timestep'], 'M'):>12}   "
        f"{_paper(paper.get('ops_per_timestep_M'), 'M')}",
        f"  training FLOPs per token  {_count(report['training_flops_per_token']):>12}   (softmax: {kind})",
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

