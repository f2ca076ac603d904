"""`moe-scale plan --plot FILE`: memory and step-time breakdown of one GPU against the number of nodes.

Two panels sharing the nodes axis: stacked bars of the memory parts (GiB) with the GPU's usable memory (after
the margin) as a line, and stacked bars of the step's parts (seconds) with tokens/s on a second axis.
"""

from __future__ import annotations

from pathlib import Path

from moe_scale.files import save_figure_atomic

MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "activations", "dispatch_buffers", "cuda_context",
                "nccl_buffers", "deepspeed_buckets", "fragmentation")
TIME_PARTS = ("compute", "waiting", "all_to_all", "vocab_exchange", "sync", "gradient_sync", "optimizer")
GIB = 2**30


def write_plot(plans: list[dict], path: Path, title: str) -> None:
    """`plans`: one per node count (the same layout otherwise), in increasing nodes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(p["nodes"]) for p in plans]
    x = range(len(plans))
    fig, (mem_axis, time_axis) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    bottom = [0.0] * len(plans)
    for part in MEMORY_PARTS:
        values = [p["bytes"][part] / GIB for p in plans]
        if any(values):
            mem_axis.bar(x, values, bottom=bottom, label=part.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values)]
    mem_axis.plot(x, [p["usable_bytes"] / GIB for p in plans], "k--", label="usable (after margin)")
    mem_axis.set_ylabel("GiB per GPU")
    mem_axis.legend(fontsize=7, ncol=2)
    mem_axis.set_title(title, fontsize=9)
    bottom = [0.0] * len(plans)
    for part in TIME_PARTS:
        values = [p["time"]["seconds"][part] for p in plans]
        time_axis.bar(x, values, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    time_axis.set_ylabel("seconds per step")
    time_axis.set_xlabel("nodes")
    time_axis.set_xticks(list(x), labels)
    time_axis.legend(fontsize=7, loc="upper left")
    rate = time_axis.twinx()
    rate.plot(list(x), [p["tokens_per_s"] for p in plans], "ko-", label="tokens/s")
    rate.set_ylabel("tokens/s")
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=100)
    plt.close(fig)
