"""Pictures of a run, written to RUN/plots/ at its end: loss and perplexity curves, and per MoE layer a heatmap
of each expert's load over training; and `eval --expert-stats`' per-expert load and importance chart.

Readable at thousands of experts: past MAX_ROWS experts the heatmap sorts them by their mean load and draws
groups of equal size (each row the mean of its group), and the bar chart becomes sorted curves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from moe_scale.files import save_figure_atomic
from moe_scale.metrics.logging import EXPERT_LOAD_LOG
from moe_scale.run_files import RunFiles

MAX_ROWS = 128      # heatmap rows (experts or groups of experts)
MAX_BARS = 64       # per-expert bars; more experts: sorted curves


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _valid_ppl(run: Path) -> list[tuple[int, float]]:
    """(step, validation perplexity) from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(RunFiles(run).tb), size_guidance={"scalars": 0})
    events.Reload()
    if "valid/ppl" not in events.Tags().get("scalars", []):
        return []
    return [(e.step, e.value) for e in events.Scalars("valid/ppl")]


def write_run_plots(run: Path, tokens_per_word: float = 1.0) -> list[Path]:
    """plots/curves.png and plots/expert_load_layer<i>.png from train_log.jsonl, the TensorBoard events and
    expert_load.jsonl; returns the files written. `tokens_per_word`: the training text's (1 for a word
    vocabulary), which turns the per-token training loss into the per-word perplexity validation reports."""
    plt = _pyplot()
    out_dir = RunFiles(run).plots
    out_dir.mkdir(exist_ok=True)
    written = []
    steps = _read_jsonl(RunFiles(run).train_log)
    if steps:
        written.append(_curves(plt, steps, _valid_ppl(run), tokens_per_word, out_dir / "curves.png"))
    loads = _read_jsonl(run / EXPERT_LOAD_LOG)
    if loads:
        for index in range(len(loads[0]["layers"])):
            matrix = np.array([record["layers"][index] for record in loads], dtype=np.float64).T   # [E, intervals]
            path = out_dir / f"expert_load_layer{index}.png"
            written.append(_load_heatmap(plt, matrix, [r["step"] for r in loads], f"layer{index}", path))
    return written


def smoothed_loss(steps: list[dict]) -> tuple[np.ndarray, np.ndarray, int]:
    """(steps, training loss per token as a running mean, its window): the mean of len/50 steps."""
    step = np.array([r["step"] for r in steps])
    loss = np.array([r["loss"] for r in steps])
    window = max(1, len(loss) // 50)
    return step[window - 1:], np.convolve(loss, np.ones(window) / window, mode="valid"), window


def perplexity_lines(steps: list[dict], valid: list[tuple[int, float]],
                     tokens_per_word: float) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """The perplexity panel's lines as (x, y, label), both per word: training exp(loss per token x tokens per
    word), as the log line reports it; validation as evaluated (exp(total NLL / words))."""
    step, smooth, window = smoothed_loss(steps)
    lines = [(step, np.exp(smooth * tokens_per_word), f"training (mean of {window} steps)")]
    if valid:
        lines.append((np.array([s for s, _ in valid]), np.array([p for _, p in valid]), "validation"))
    return lines


def _curves(plt, steps: list[dict], valid: list[tuple[int, float]], tokens_per_word: float, path: Path) -> Path:
    step = np.array([r["step"] for r in steps])
    loss = np.array([r["loss"] for r in steps])
    smooth_step, smooth, window = smoothed_loss(steps)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(step, loss, color="tab:blue", alpha=0.3, linewidth=0.8, label="per step")
    left.plot(smooth_step, smooth, color="tab:blue", label=f"mean of {window} steps")
    left.set(xlabel="step", ylabel="training loss (nats per token)", title="Training loss")
    left.legend()
    for (x, y, label), style in zip(perplexity_lines(steps, valid, tokens_per_word),
                                    ({"color": "tab:blue"}, {"color": "tab:orange", "marker": "o"})):
        right.plot(x, y, label=label, **style)
    unit = "word" if tokens_per_word == 1.0 else f"word ({tokens_per_word:.3f} tokens per word)"
    right.set(xlabel="step", ylabel=f"perplexity per {unit}", yscale="log", title="Perplexity per word")
    right.legend()
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=110)
    plt.close(fig)
    return path


def heatmap_rows(load_by_interval: np.ndarray) -> tuple[np.ndarray, str]:
    """(rows to draw, their axis label): every expert, or past MAX_ROWS the experts sorted by mean load (most
    loaded first) in groups of equal size, each row its group's mean."""
    E = load_by_interval.shape[0]
    if E <= MAX_ROWS:
        return load_by_interval, "expert"
    order = np.argsort(-load_by_interval.mean(axis=1), kind="stable")
    group = math.ceil(E / MAX_ROWS)
    rows = [load_by_interval[order[i:i + group]].mean(axis=0) for i in range(0, E, group)]
    return np.array(rows), f"experts sorted by mean load (most first), {group} per row (row mean)"


def _load_heatmap(plt, load_by_interval: np.ndarray, steps: list[int], layer: str, path: Path) -> Path:
    """Rows: experts (or groups of experts sorted by mean load), columns: logging intervals, colour: load / mean
    on a log scale centred on 1 (even)."""
    E = load_by_interval.shape[0]
    matrix, ylabel = heatmap_rows(load_by_interval)
    fig, ax = plt.subplots(figsize=(10, 5))
    image = ax.imshow(np.log2(np.clip(matrix, 1 / 8, 8)), aspect="auto", cmap="RdBu_r", vmin=-3, vmax=3,
                      interpolation="nearest",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, matrix.shape[0] - 0.5, -0.5))
    bar = fig.colorbar(image, ax=ax, ticks=[-3, -2, -1, 0, 1, 2, 3])
    bar.ax.set_yticklabels(["≤1/8", "1/4", "1/2", "1 (even)", "2", "4", "≥8"])
    bar.set_label("tokens routed / mean over experts")
    ax.set(xlabel="step (end of logging interval)", ylabel=ylabel,
           title=f"{layer}: tokens routed to each of {E} experts per logging interval")
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=110)
    plt.close(fig)
    return path


def write_expert_stats_plot(report: dict, path: Path) -> Path:
    """Per MoE layer of an `eval --expert-stats` report: each expert's share of the routed tokens (load) and of
    the gate mass (importance), against the even share 1/E."""
    plt = _pyplot()
    layers = list(report.items())
    fig, axes = plt.subplots(len(layers), 1, figsize=(10, 3.6 * len(layers)), squeeze=False)
    for ax, (name, stats) in zip(axes[:, 0], layers):
        load = np.array([e["load"] for e in stats["experts"]], dtype=np.float64)
        importance = np.array([e["importance"] for e in stats["experts"]], dtype=np.float64)
        load, importance = load / max(load.sum(), 1e-12), importance / max(importance.sum(), 1e-12)
        E = len(load)
        if E <= MAX_BARS:
            x = np.arange(E)
            ax.bar(x - 0.2, load, width=0.4, label="load (share of routed tokens)")
            ax.bar(x + 0.2, importance, width=0.4, label="importance (share of gate mass)")
            ax.set(xlabel="expert", xticks=x if E <= 32 else x[::max(1, E // 16)])
        else:
            rank = np.arange(1, E + 1)
            ax.plot(rank, np.sort(load)[::-1], label="load (share of routed tokens)")
            ax.plot(rank, np.sort(importance)[::-1], label="importance (share of gate mass)")
            ax.set(xlabel="experts, sorted by share (each curve on its own)", yscale="log")
        ax.axhline(1 / E, color="gray", linestyle="--", linewidth=1, label=f"even share 1/{E}")
        ax.set(ylabel="share", title=f"{name}: cv(load) {stats['cv_load']:.3f}, cv(importance) "
                                     f"{stats['cv_importance']:.3f}, {stats['tokens']} routed token copies")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure_atomic(fig, path, dpi=110)
    plt.close(fig)
    return path
