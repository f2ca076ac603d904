"""The text `moe-scale plan` prints: one layout's memory and step time (times in the unit that shows them: s, ms,
µs), its warnings and remarks, the time to train on --tokens, and the --search table."""

from __future__ import annotations

from moe_scale.accounting.memory import GIB
from moe_scale.accounting.plan import MAX_NODES
from moe_scale.accounting.units import count_text, duration_text, seconds_text

MEMORY_ROWS = ("parameters", "gradients", "optimizer_state", "activations", "dispatch_buffers", "cuda_context",
               "nccl_buffers", "deepspeed_buckets", "fragmentation")


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _time(seconds: float) -> str:
    return f"{seconds_text(seconds):>10}"


def training_text(training: dict, world: int) -> str:
    return (f"{count_text(training['tokens'])} tokens: {duration_text(training['wall_s'])} on {world:,} GPUs, "
            f"{_hours(training['gpu_hours'])} GPU-hours, {training['steps']:,} steps")


def _hours(hours: float) -> str:
    return f"{hours:,.0f}" if hours >= 1000 else f"{hours:.3g}"


def _etp(r: dict) -> str:
    """' x etp T' where each expert's hidden units are split over T ranks."""
    return f" x etp {r['etp_size']}" if r.get("etp_size", 1) > 1 else ""


def format_plan(r: dict, smallest: dict | None) -> str:
    t = r["time"]
    s = t["seconds"]
    lines = [f"{r['preset']} on {r['nodes']} node(s) x {r['gpus_per_node']} {r['gpu']} ({r['world']} GPUs, "
             f"{r['gpu_mem_bytes'] / GIB:.2f} GiB each), ep {r['ep_size']}{_etp(r)}, ZeRO-{r['zero_stage']}, "
             f"{r['optimizer']} expert optimizer, {r['precision']}, {r['all_to_all']} all-to-all"
             f"{', expert recompute' if r['recompute'] else ''}"
             f"{', routing forced balanced (--force-balanced-routing)' if r['force_balanced_routing'] else ''}",
             *([f"  {r['ep_size_reason']}"] if "ep_size_reason" in r else []),
             f"  {_count(r['params_total'])} parameters, {r['flops_per_token'] / 1e6:,.1f} MFLOPs per token; batch "
             f"{r['tokens_per_step']:,} tokens ({r['batch_sequences']:,} sequences), "
             f"{r['tokens_per_gpu']:,.0f} per GPU",
             f"  per GPU: {r['experts_per_gpu']} experts, {_count(r['params_per_gpu'])} parameters",
             "  memory per GPU                  GiB"]
    lines += [f"    {name.replace('_', ' '):<26}{r['bytes'][name] / GIB:8.2f}" for name in MEMORY_ROWS
              if r["bytes"][name]]
    verdict = "fits" if r["fits"] else "does NOT fit"
    lines.append(f"    {'total':<26}{r['bytes']['total'] / GIB:8.2f}   {verdict}: {r['usable_bytes'] / GIB:.2f} GiB "
                 f"usable ({r['margin']:.0%} margin)")
    if r["dispatch_load"] < r["ep_size"]:
        lines.append(f"    (dispatch buffers at {r['dispatch_load']:g}x the balanced load; all tokens on one rank "
                     f"would need {r['all_to_one_bytes'] / GIB:.2f} GiB)")
    if t["compute_bound"] == "launches":
        compute_note = (f"the launch floor: {t['launches']['operations'] + t['launches']['recurrence']:,} launches "
                        f"x {seconds_text(t['launches']['launch_s'])}; FLOPs {seconds_text(t['flops_s'])}")
    else:
        compute_note = f"{t['gemm_efficiency']:.1%} of {t['peak_tflops']:g} TFLOPS"
    lines += ["  step time",
              f"    compute                   {_time(s['compute'])}   ({compute_note})",
              *([f"    waiting for stragglers    {_time(s['waiting'])}"] if s["waiting"] else []),
              f"    {'all-to-all (' + r['all_to_all'] + ')':<26}{_time(s['all_to_all'])}"
              + (f"   (in {t['a2a_chunks']} pieces beside the experts: {seconds_text(t['all_to_all_hidden_s'])}, "
                 f"{t['all_to_all_hidden_share']:.0%} of the exchange, hidden)" if t.get("a2a_chunks", 1) > 1 else ""),
              *([f"    vocabulary rows exchanged {_time(s['vocab_exchange'])}"] if s["vocab_exchange"] else []),
              f"    router and norm sums      {_time(s['sync'])}",
              f"    gradient sync             {_time(s['gradient_sync'])}   "
              f"({'overlapped with the backward, ' if t['gradient_sync_overlapped'] else ''}"
              f"{seconds_text(t['gradient_sync_total_s'])} in all)",
              f"    optimizer                 {_time(s['optimizer'])}",
              f"    step                      {_time(s['step'])}",
              f"  {r['tokens_per_s']:,.0f} tokens/s, {r['tflops_per_gpu']:.3g} TFLOPS/GPU, MFU {r['mfu']:.1%}"]
    if "training" in r:
        lines.append(f"  {training_text(r['training'], r['world'])}")
    lines += [f"  warning: {w}" for w in r.get("warnings", [])]
    lines += [f"  remark: {w}" for w in r.get("remarks", [])]
    if smallest is None:
        lines.append(f"  no cluster of up to {MAX_NODES} nodes x {r['gpus_per_node']} GPUs fits this layout")
    else:
        lines.append(f"  smallest that fits: {smallest['nodes']} node(s) x {smallest['gpus_per_node']} = "
                     f"{smallest['world']} GPUs ({smallest['bytes']['total'] / GIB:.2f} GiB per GPU)")
    return "\n".join(lines)


def format_search(found: dict) -> str:
    tokens = found["ranked"][0].get("training", {}).get("tokens") if found["ranked"] else None
    wall = f"  {count_text(tokens) + ' tokens':>12}" if tokens else ""
    lines = [f"layouts that fit, by predicted tokens/s ({len(found['ranked'])} shown; {found['considered']} "
             f"considered, {found['too_large']} too large, {sum(found['refused'].values())} refused by train)",
             "  rank nodes GPUs   ep etp ZeRO optimizer recompute a2a      GiB/GPU       step    tokens/s  TFLOPS/GPU"
             f"   MFU{wall}"]
    for i, r in enumerate(found["ranked"], 1):
        lines.append(f"  {i:4} {r['nodes']:5} {r['world']:4} {r['ep_size']:4} {r.get('etp_size', 1):3} "
                     f"{r['zero_stage']:4} "
                     f"{r['optimizer']:<9} {'yes' if r['recompute'] else 'no':<9} {r['all_to_all'][:4]:<6} "
                     f"{r['bytes']['total'] / GIB:9.2f} {_time(r['time']['seconds']['step'])} "
                     f"{r['tokens_per_s']:11,.0f} {r['tflops_per_gpu']:11.3g} {r['mfu']:5.1%}"
                     + (f"  {duration_text(r['training']['wall_s']):>12}" if "training" in r else ""))
    if found["too_large"]:
        least = found["too_large_least"]
        lines.append(f"  too large ({found['too_large']}): does not fit, the least of them needs "
                     f"{least['bytes'] / GIB:.2f} GiB per GPU > {least['usable_bytes'] / GIB:.2f} GiB usable "
                     f"({least['gpu_mem_bytes'] / GIB:.2f} GiB less the {least['margin']:.0%} margin; "
                     f"{least['layout']})")
    for reason, count in sorted(found["refused"].items()):
        lines.append(f"  refused by train ({count}): {reason}")
    return "\n".join(lines)
