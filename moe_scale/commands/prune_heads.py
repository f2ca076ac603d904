"""`moe-scale prune-heads`: head importance, global iterative pruning, perplexity and speed of each pruned model.

    moe-scale prune-heads --run DIR [--data PATH] [--steps 10] [--fraction-per-step 0.1] [--out DIR]

Scores come once from the unpruned model (the released codes' default) or, with --recompute-importance,
again from the pruned model after every step. Step i removes heads until floor(i·fraction·total) are gone,
physically, then measures perplexity on the data and the forward speed-up over the unpruned model (the
median over 7 repeats of the time ratio over 4 batches, the two models timed in turn within each repeat, so
both see the same machine load). Writes pruning.json, pruning.md and pruning.png (perplexity and speed-up against the
fraction pruned) to --out (default DIR/pruning), only once everything is computed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from moe_scale.attention.prune_schedule import prune_schedule
from moe_scale.attention.pruning import (ABS_GRANULARITIES, apply_pruning, head_importance, heads_to_prune,
                                         prunable_layers)
from moe_scale.commands.help_format import HelpFormatter
from moe_scale.commands.run_flags import add_run_flags
from moe_scale.data import LMWindows, load_sentences, resolve_text_files
from moe_scale.errors import UserError
from moe_scale.labels import IGNORE
from moe_scale.models.build import parameter_counts
from moe_scale.run_files import RunFiles
from moe_scale.train.data_setup import load_run_splits, min_over_ranks
from moe_scale.inference.trained_run import open_trained_run
from moe_scale.train.evaluate import evaluate
from moe_scale.files import save_figure_atomic, write_json_atomic, write_text_atomic

TIMING_BATCHES = 4
TIMING_REPEATS = 7


def add_parser(sub) -> None:
    p = sub.add_parser("prune-heads", formatter_class=HelpFormatter,
                       help="head importance and global head pruning of a transformer run (Michel et al. 2019)",
                       description="Head importance of a transformer run (Michel et al. 2019) and global "
                                   "iterative head pruning: perplexity and forward speed-up of each pruned "
                                   "model, written to pruning.json, pruning.md and pruning.png.")
    add_run_flags(p, "prune")
    p.add_argument("--data", metavar="PATH", help="text for importance and perplexity per token over full "
                                                  "windows (default: the run's validation split)")
    p.add_argument("--steps", type=int, default=10, help="pruning steps (the first prunes nothing)")
    p.add_argument("--fraction-per-step", type=float, default=0.1, help="share of all heads removed per step")
    p.add_argument("--max-batches", type=int, default=0, help="cap on batches of the data (0: all)")
    p.add_argument("--abs-granularity", choices=ABS_GRANULARITIES, default="token",
                   help="|A·dL/dA| per token (released code) or per sequence (paper)")
    p.add_argument("--recompute-importance", action="store_true", help="re-score the pruned model every step")
    p.add_argument("--out", metavar="DIR", help="where pruning.{json,md,png} go (default: RUN/pruning)")
    p.set_defaults(run_command=run)


def run(args: argparse.Namespace) -> None:
    prune_schedule(1, args.fraction_per_step, args.steps)   # flag errors before the slow work
    print(format_report(run_prune_heads(args.run, args.data, args.steps, args.fraction_per_step, args.max_batches,
                                        args.abs_granularity, args.recompute_importance, args.out,
                                        args.checkpoint)))


def _require_prunable(run: Path, config) -> None:
    if config.model.kind != "transformer" or config.attention.kind == "moa":
        what = "an LSTM" if config.model.kind != "transformer" else "an MoA"
        raise UserError(f"--run {run} holds {what} model; prune-heads works on transformer runs with "
                        f"--attention mha or mae")


def run_prune_heads(run_dir: str, data: str | None, steps: int, fraction_per_step: float, max_batches: int,
                    abs_granularity: str, recompute: bool, out: str | None, checkpoint: str | None = None) -> dict:
    run = Path(run_dir)
    if max_batches < 0:
        raise UserError(f"--max-batches must be 0 (all) or positive (got {max_batches})")
    prune_schedule(1, fraction_per_step, steps)   # flag errors before any loading
    out_dir = Path(out) if out else RunFiles(run).pruning
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file; choose a directory")
    trained = open_trained_run(run, checkpoint, "prune-heads", check=lambda config, _: _require_prunable(run, config))
    config, vocab, model, tag, device = (trained.config, trained.tokenizer, trained.model, trained.checkpoint,
                                         trained.env.device)
    sentences = load_sentences(resolve_text_files(data, "--data")) if data else load_run_splits(config.data)[1]
    windows = LMWindows(sentences, vocab, seq_len=config.data.seq_len, global_rows=config.train.batch_size,
                        rank=0, world_size=1, min_over_ranks=min_over_ranks,
                        what="the pruning data" if data else "the validation data")
    batches = _batches(windows, max_batches)
    layers = prunable_layers(model)
    num_heads = config.attention.num_heads
    total = len(layers) * num_heads
    schedule = prune_schedule(total, fraction_per_step, steps)
    scores = head_importance(model, batches, num_heads, abs_granularity, device)
    # the unpruned model to time against, opened again: copy.deepcopy cannot copy an MoE layer's process groups
    unpruned = open_trained_run(run, tag, "prune-heads").model
    pruned: list[tuple[int, int]] = []
    rows = []
    for target in schedule:
        if recompute and pruned:
            scores = head_importance(model, batches, num_heads, abs_granularity, device)
        new = heads_to_prune(scores, target - len(pruned), set(pruned))
        apply_pruning(model, new)
        pruned += new
        base_seconds, seconds = _forward_seconds([unpruned, model], batches[:TIMING_BATCHES], device)
        speedup = _speedup(base_seconds, seconds)
        result = evaluate(model, _Replay(batches), device=device)
        rows.append({"fraction_pruned": len(pruned) / total, "heads_pruned": len(pruned),
                     "heads_left": total - len(pruned), "params": parameter_counts(model)["total"],
                     "ppl": result["ppl"], "forward_seconds": min(seconds),
                     "unpruned_forward_seconds": min(base_seconds), "speedup": speedup,
                     "pruned_heads": [list(h) for h in pruned]})
    report = {"run": str(run), "checkpoint": tag, "data": data or "valid", "tokens": result["tokens"],
              "ppl_kind": "per token over full windows of the data (eval reports per word)",
              "abs_granularity": abs_granularity, "recompute_importance": recompute,
              "importance": scores.tolist(), "steps": rows}
    _write(out_dir, report)
    return report


def _batches(windows: LMWindows, max_batches: int) -> list:
    batches = []
    for index, batch in enumerate(windows.all_windows()):
        if max_batches and index >= max_batches:
            break
        batches.append(batch)
    return batches


class _Replay:
    """The fixed batches in the shape `evaluate` reads; every target counts as one unit of the perplexity (per
    token, not per word: these are training windows)."""

    def __init__(self, batches):
        self.batches = batches

    def all_windows(self):
        return iter(self.batches)

    def counted_words(self, index: int) -> int:
        return int((self.batches[index][1] != IGNORE).sum())

    def real_tokens(self, index: int) -> None:
        """Training windows hold no padding: every input is a real token."""
        return None


@torch.no_grad()
def _forward_seconds(models, batches, device, repeats: int = TIMING_REPEATS) -> list[list[float]]:
    """Seconds of each model over the batches, per repeat; the models run in turn within each repeat, so a
    busy machine slows them alike and the per-repeat ratios stay comparable."""
    seconds = [[] for _ in models]
    for _ in range(repeats):
        for index, model in enumerate(models):
            model.eval()
            began = time.perf_counter()
            for inputs, targets in batches:
                model(inputs.to(device), targets.to(device))
            seconds[index].append(time.perf_counter() - began)
    return seconds


def _speedup(base_seconds: list[float], seconds: list[float]) -> float:
    """Median over repeats of unpruned time / pruned time."""
    return statistics.median(b / s for b, s in zip(base_seconds, seconds))


def _write(out_dir: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out_dir}: cannot create it ({e.strerror}); choose a writable directory")
    rows = report["steps"]
    lines = ["| fraction pruned | heads left | params | perplexity per token | speed-up |", "|---|---|---|---|---|"]
    lines += [f"| {r['fraction_pruned']:.3f} | {r['heads_left']} | {r['params']:,} | {r['ppl']:.2f} | "
              f"{r['speedup']:.3f} |" for r in rows]
    figure, ppl_axis = plt.subplots(figsize=(6, 4))
    fractions = [r["fraction_pruned"] for r in rows]
    ppl_axis.plot(fractions, [r["ppl"] for r in rows], "o-", color="tab:blue")
    ppl_axis.set_xlabel("fraction of heads pruned")
    ppl_axis.set_ylabel("perplexity per token (full windows)", color="tab:blue")
    speed_axis = ppl_axis.twinx()
    speed_axis.plot(fractions, [r["speedup"] for r in rows], "s--", color="tab:red")
    speed_axis.set_ylabel("forward speed-up", color="tab:red")
    ppl_axis.set_title(f"head pruning: {report['run']}")
    figure.tight_layout()
    save_figure_atomic(figure, out_dir / "pruning.png")
    plt.close(figure)
    write_text_atomic(out_dir / "pruning.md", "\n".join(lines) + "\n")
    write_json_atomic(out_dir / "pruning.json", report)


def format_report(report: dict) -> str:
    return "\n".join(f"pruned {r['fraction_pruned']:.3f}  heads left {r['heads_left']:3d}  "
                     f"ppl/token {r['ppl']:9.2f}  speed-up {r['speedup']:.3f}" for r in report["steps"])
