"""The text `moe-scale plan` prints: one layout's memory and step time, and the --search table."""

from __future__ import annotations

from moe_scale.accounting.memory import GIB
from moe_scale.accounting.plan import MAX_NODES

MEMORY_ROWS = ("parameters", "gradients", "optimizer_state", "activations", "dispatch_buffers", "cuda_context",
               "nccl_buffers", "deepspeed_buckets", "fragmentation")


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_plan(r: dict, smallest: dict | None) -> str:
    t = r["time"]
    s = t["seconds"]
    lines = [f"{r['preset']} on {r['nodes']} node(s) x {r['gpus_per_node']} {r['gpu']} ({r['world']} GPUs, "
             f"{r['gpu_mem_bytes'] / GIB:.2f} GiB each), ep {r['ep_size']}, ZeRO-{r['zero_stage']}, "
             f"{r['optimizer']} expert optimizer, {r['precision']}, {r['all_to_all']} all-to-all"
             f"{', expert recompute' if r['recompute'] else ''}"
             f"{', routing forced balanced (--force-balanced-routing)' if r['force_balanced_routing'] else ''}",
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
    lines += ["  step time                         s",
              f"    compute                   {s['compute']:10.4f}   ({t['efficiency']:.0%} of "
              f"{t['peak_tflops']:g} TFLOPS)",
              *([f"    waiting for stragglers    {s['waiting']:10.4f}"] if s["waiting"] else []),
              f"    {'all-to-all (' + r['all_to_all'] + ')':<26}{s['all_to_all']:10.4f}",
              *([f"    vocabulary rows exchanged {s['vocab_exchange']:10.4f}"] if s["vocab_exchange"] else []),
              f"    router and norm sums      {s['sync']:10.4f}",
              f"    gradient sync             {s['gradient_sync']:10.4f}   "
              f"({'overlapped with the backward, ' if t['gradient_sync_overlapped'] else ''}"
              f"{t['gradient_sync_total_s']:.4f} in all)",
              f"    optimizer                 {s['optimizer']:10.4f}",
              f"    step                      {s['step']:10.4f}",
              f"  {r['tokens_per_s']:,.0f} tokens/s, {r['tflops_per_gpu']:.3g} TFLOPS/GPU, MFU {r['mfu']:.1%}"]
    if smallest is None:
        lines.append(f"  no cluster of up to {MAX_NODES} nodes x {r['gpus_per_node']} GPUs fits this layout")
    else:
        lines.append(f"  smallest that fits: {smallest['nodes']} node(s) x {smallest['gpus_per_node']} = "
                     f"{smallest['world']} GPUs ({smallest['bytes']['total'] / GIB:.2f} GiB per GPU)")
    return "\n".join(lines)


def format_search(found: dict) -> str:
    lines = [f"layouts that fit, by predicted tokens/s ({len(found['ranked'])} shown; {found['considered']} "
             f"considered, {found['too_large']} too large, {sum(found['refused'].values())} refused by train)",
             "  rank nodes GPUs   ep ZeRO optimizer recompute a2a      GiB/GPU  step s    tokens/s  TFLOPS/GPU   MFU"]
    for i, r in enumerate(found["ranked"], 1):
        lines.append(f"  {i:4} {r['nodes']:5} {r['world']:4} {r['ep_size']:4} {r['zero_stage']:4} "
                     f"{r['optimizer']:<9} {'yes' if r['recompute'] else 'no':<9} {r['all_to_all'][:4]:<6} "
                     f"{r['bytes']['total'] / GIB:9.2f} {r['time']['seconds']['step']:7.3f} "
                     f"{r['tokens_per_s']:11,.0f} {r['tflops_per_gpu']:11.3g} {r['mfu']:5.1%}")
    for reason, count in sorted(found["refused"].items()):
        lines.append(f"  refused by train ({count}): {reason}")
    return "\n".join(lines)
