#!/usr/bin/env python
"""Shazeer et al.'s central claim in small (§5.1, Fig. 2-left, Table 7): more experts at equal compute.

Trains computationally matched LSTM LMs on real text: the dense baselines (lstm-ffn-lstm, 4xlstm), flat MoE-4,
MoE-32, MoE-256, hierarchical MoE-256-h, MoE-1024-h, MoE-4096-h (and MoE-16384-h on 2 processes, --ep-size 2,
with --with-16384). Every model has the dense baseline's ops/timestep (forward multiply-adds per token, gates
included, embedding and softmax excluded: `moe-scale flops`'s count) within --match (5%): each MoE's expert
width is chosen to fill the budget its gate leaves, the 4xlstm's LSTM width likewise; a model that cannot be
matched is refused. The same text, tokens, schedule and seeds for all.

    python tools/capacity_sweep.py --out runs/capacity                      # WikiText-2, 2 seeds
    python tools/capacity_sweep.py --out runs/capacity --models dense,moe-32 --seeds 1 --max-steps 50

Writes OUT/capacity.json, OUT/capacity.md (one row per model: ops/timestep, parameters without embedding and
softmax, held-out (test), first-pass (text not trained on yet: the second half of the first epoch) and training
perplexity per seed with their spread, tokens/s and TFLOPS/device, tokens/s against the dense baseline, a link to
every run directory; a finished run's checkpoints are deleted once it is scored unless --keep-checkpoints),
OUT/capacity_ppl.png (the three perplexities against parameters, log x: Figure 2-left's
form) and OUT/capacity_speed.png (tokens/s and TFLOPS/device against experts,
the dense baseline as a line). Runs live in OUT/runs/<model>-s<seed>/; a killed sweep, started again with the
same flags, keeps the finished runs, resumes a run from its last checkpoint, and starts the rest.
Exit status: 0 done; 1 a run failed; 2 a bad flag or a model that cannot be matched.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tool_args import OneLineParser, positive_float, positive_int, positive_int_list

from moe_scale.distributed.ports import free_port

REPO = Path(__file__).resolve().parents[1]
DENSE = "dense"
MIN_EXPERT_HIDDEN = 8


@dataclass
class Model:
    name: str
    settings: dict                 # RunConfig keys (moe_scale.config) -> values
    experts: int = 0               # 0: dense
    procs: int = 1
    ops: int = 0                   # forward MACs per token (moe-scale flops)
    params: int = 0                # parameters without embedding and softmax

    @property
    def flags(self) -> list[str]:
        """`moe-scale train` flags for `settings`."""
        return [part for key, value in self.settings.items() for part in (f"--{key.replace('_', '-')}", str(value))]


# name -> (gate, experts, groups, active experts (k or kp x ks), processes)
MOE = {"moe-4": ("noisy_topk", 4, 0, 4, 1), "moe-32": ("noisy_topk", 32, 0, 4, 1),
       "moe-256": ("noisy_topk", 256, 0, 4, 1), "moe-256-h": ("hierarchical", 256, 16, 4, 1),
       "moe-1024-h": ("hierarchical", 1024, 32, 4, 1), "moe-4096-h": ("hierarchical", 4096, 64, 4, 1),
       "moe-16384-h": ("hierarchical", 16384, 128, 4, 2)}
ALL = [DENSE, "4xlstm", *MOE]


def _accounting(settings: dict, vocab: int):
    from moe_scale.accounting.flops import lstm_lm_accounting
    from moe_scale.config import RunConfig

    return lstm_lm_accounting(RunConfig.from_settings(**settings), vocab)


def model_table(names: list[str], d: int, ffn_hidden: int, vocab: int, match: float) -> list[Model]:
    """The models, each matched to the dense baseline's ops/timestep; ValueError names one that cannot be."""
    base = {"d_model": d, "layout": "lstm-ffn-lstm", "expert_hidden": ffn_hidden}
    target = _accounting(base, vocab).ops_per_timestep
    models = []
    for name in names:
        if name == DENSE:
            settings, experts, procs = base, 0, 1
        elif name == "4xlstm":   # four LSTMs of the width (>= d, projected back to d) that spends the budget
            settings, experts, procs = min(
                ({"d_model": d, "layout": "4xlstm", "lstm_hidden": h} for h in range(d, 4 * d + 1)),
                key=lambda s: abs(_accounting(s, vocab).ops_per_timestep - target)), 0, 1
        else:
            gate, experts, groups, active, procs = MOE[name]
            settings = {"d_model": d, "layout": "lstm-moe-lstm", "gate": gate, "num_experts": experts,
                        "top_k": active if gate != "hierarchical" else 2, "expert_hidden": 1}
            if gate == "hierarchical":
                settings.update(num_groups=groups, top_k_secondary=active // 2)
            if procs > 1:
                settings["ep_size"] = procs
            without = _accounting(settings, vocab).ops_per_timestep - active * 2 * d   # all but the experts
            settings["expert_hidden"] = round((target - without) / (active * 2 * d))
            if settings["expert_hidden"] < MIN_EXPERT_HIDDEN:
                raise ValueError(f"{name}: its gate leaves its {active} active experts a width of "
                                 f"{max(settings['expert_hidden'], 0)} (at least {MIN_EXPERT_HIDDEN} needed) at "
                                 f"the dense baseline's {target:,} ops/timestep; raise --ffn-hidden or --d-model, "
                                 f"or leave {name} out")
        counts = _accounting(settings, vocab)
        if abs(counts.ops_per_timestep - target) > match * target:
            why = "its gate alone costs too much at this size" if experts else "no LSTM width comes closer"
            raise ValueError(f"{name}: {counts.ops_per_timestep:,} ops/timestep against the dense baseline's "
                             f"{target:,} (more than {match:.0%} apart: {why}); raise --ffn-hidden or --d-model, "
                             f"or leave {name} out")
        models.append(Model(name, settings, experts, procs, counts.ops_per_timestep,
                            counts.params_excluding_embedding_softmax))
    return models


def parse_args(argv: list[str]):
    p = OneLineParser(prog="capacity_sweep.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for runs and the report")
    wikitext = REPO.parent / "shared" / "data" / "wikitext-2"
    p.add_argument("--data", default=str(wikitext / "valid.txt"),
                   help="real training text, one sentence per line (default: WikiText-2's valid.txt; its last 1%% "
                        "is held out for validation)")
    p.add_argument("--test-data", default=str(wikitext / "test.txt"),
                   help="the held-out text every model is scored on (default: WikiText-2's test.txt)")
    p.add_argument("--models", default=",".join(m for m in ALL if m != "moe-16384-h"),
                   help=f"comma-separated, of {', '.join(ALL)}")
    p.add_argument("--with-16384", action="store_true", help="add MoE-16384-h (2 processes, --ep-size 2)")
    p.add_argument("--seeds", type=positive_int_list, default=[1, 2])
    p.add_argument("--d-model", type=positive_int, default=128)
    p.add_argument("--ffn-hidden", type=positive_int, default=1024,
                   help="the dense baseline's FFN width: sets the ops/timestep every model matches (8 x d: the FFN "
                        "costs as much as the two LSTMs and 4xlstm matches, as in the paper's Table 7)")
    p.add_argument("--vocab-size", type=positive_int, default=10000)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--seq-len", type=positive_int, default=32)
    p.add_argument("--max-steps", type=positive_int, default=600)
    p.add_argument("--checkpoint-interval", type=positive_int, default=200)
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each finished point's last checkpoint (by default it is deleted once the point's test "
                        "perplexity is written: at thousands of experts a checkpoint takes GBs)")
    p.add_argument("--match", type=positive_float, default=0.05, help="largest relative ops/timestep difference")
    p.add_argument("--extra", nargs="...", default=[], help="the rest goes to every `moe-scale train`")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL]
    if unknown or not names:
        p.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(ALL)}")
    if args.with_16384 and "moe-16384-h" not in names:
        names.append("moe-16384-h")
    if DENSE not in names:
        names.insert(0, DENSE)   # every ratio is against it
    args.names = names
    for flag, path in (("--data", args.data), ("--test-data", args.test_data)):
        if not Path(path).exists():
            p.error(f"{flag} {path}: no such file or directory; point it at real text (WikiText-2 is in "
                    f"../shared/data/wikitext-2 beside a development checkout)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {args.out} is a file; give a directory")
    try:
        args.table = model_table(names, args.d_model, args.ffn_hidden, args.vocab_size, args.match)
    except ValueError as e:
        p.error(str(e))
    return args


def _train(model: Model, seed: int, run: Path, args, log) -> None:
    """Runs (or resumes) one point; a finished one (summary.json) is left alone."""
    if (run / "summary.json").is_file():
        return
    resume = (run / "checkpoints" / "complete").is_file()
    if run.exists() and not resume:
        shutil.rmtree(run)   # killed before its first checkpoint: start it again
    common = ["train", "--data", args.data, "--test-data", args.test_data, "--vocab-size", str(args.vocab_size),
              "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--max-steps", str(args.max_steps),
              "--seed", str(seed), "--checkpoint-interval", str(args.checkpoint_interval),
              "--keep-checkpoints", "1",   # the one eval, generate and export read (thousands of experts: GBs each)
              "--eval-interval", str(args.max_steps), "--log-interval", str(max(1, args.max_steps // 10)),
              "--out", str(run)]
    if resume:
        common = ["train", "--resume", "--out", str(run)]
    else:
        common += model.flags + list(args.extra)
    if model.procs == 1:
        cmd = [sys.executable, "-m", "moe_scale", *common]
    else:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(model.procs), "--master_port",
               str(free_port()), "--module", "moe_scale", *common]
    with open(log, "a") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=_env())
    if proc.returncode != 0 or not (run / "summary.json").is_file():
        raise RuntimeError(f"{model.name} seed {seed} failed (exit {proc.returncode}); see {log}")


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _test_ppl(run: Path, log: Path) -> float:
    """Test perplexity per word of the finished run (cached in the run directory)."""
    cached = run / "capacity_test.json"
    if not cached.is_file():
        with open(log, "a") as f:
            proc = subprocess.run([sys.executable, "-m", "moe_scale", "eval", "--run", str(run), "--split", "test",
                                   "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=f, text=True,
                                  env=_env())
        if proc.returncode != 0:
            raise RuntimeError(f"evaluating {run} failed (exit {proc.returncode}); see {log}")
        tmp = cached.with_suffix(".tmp")
        tmp.write_text(proc.stdout)
        tmp.replace(cached)
    return json.loads(cached.read_text())["ppl"]


def _first_pass_ppl(run: Path, log: Path, tokens_per_word: float) -> float | None:
    """Perplexity per word on text the model had not trained on yet: exp(mean training loss over the second half of
    the first pass over the data, dropout on). None if the log does not say how long a pass is."""
    found = re.findall(r"(\d+) steps per epoch", log.read_text(errors="replace"))
    if not found:
        return None
    epoch = int(found[0])
    losses = {}
    for line in (run / "train_log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and epoch // 2 < record["step"] <= epoch:
            losses[record["step"]] = record["loss"]   # a resumed run logs some steps again: the last one counts
    return math.exp(statistics.fmean(losses.values()) * tokens_per_word) if losses else None


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "values": values}


def sweep(args) -> dict:
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    results = {m.name: {"seeds": {}} for m in args.table}
    for seed in args.seeds:          # seed-major: every model once before any twice (drift spreads evenly)
        for model in args.table:
            run, log = out / "runs" / f"{model.name}-s{seed}", out / "logs" / f"{model.name}-s{seed}.log"
            print(f"capacity_sweep: {model.name} seed {seed}", file=sys.stderr, flush=True)
            _train(model, seed, run, args, log)
            summary = json.loads((run / "summary.json").read_text())
            test_ppl = _test_ppl(run, log)
            if not args.keep_checkpoints:   # scored: nothing of the sweep reads them again (GBs each)
                shutil.rmtree(run / "checkpoints", ignore_errors=True)
            results[model.name]["seeds"][seed] = {
                "run": str(run.relative_to(out)), "test_ppl": test_ppl, "valid_ppl": summary["valid_ppl"],
                "first_pass_ppl": _first_pass_ppl(run, log, summary["tokens_per_word"]),
                "train_ppl": summary["train_ppl"], "tokens_per_s": summary["tokens_per_s"],
                "tflops_per_device": summary["tflops_per_device"]}
    dense_speed = statistics.fmean(r["tokens_per_s"] for r in results[DENSE]["seeds"].values())
    rows = []
    for model in args.table:
        seeds = results[model.name]["seeds"]
        row = {"model": model.name, "experts": model.experts, "processes": model.procs, "ops_per_timestep": model.ops,
               "params_excluding_embedding_softmax": model.params, "flags": model.flags, "seeds": seeds}
        for key in ("test_ppl", "first_pass_ppl", "train_ppl", "tokens_per_s", "tflops_per_device"):
            values = [s[key] for s in seeds.values()]
            row[key] = _spread(values) if None not in values else None
        row["speed_vs_dense"] = row["tokens_per_s"]["mean"] / dense_speed
        if model.experts:
            row["speed_target"] = 0.6 if model.procs > 1 else 0.8
            row["meets_speed_target"] = row["speed_vs_dense"] >= row["speed_target"]
        rows.append(row)
    report = {"data": args.data, "d_model": args.d_model, "ffn_hidden": args.ffn_hidden, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "max_steps": args.max_steps, "seeds": args.seeds,
              "tokens_per_run": args.batch_size * args.seq_len * args.max_steps, "rows": rows}
    (out / "capacity.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "capacity.md").write_text(markdown(report))
    plots(report, out)
    return report


def _pm(spread: dict, digits: int = 1) -> str:
    half = (spread["max"] - spread["min"]) / 2
    return f"{spread['mean']:.{digits}f} ± {half:.{digits}f}"


def markdown(report: dict) -> str:
    lines = [f"# Capacity sweep: {report['data']}, d_model {report['d_model']}, {report['tokens_per_run']:,} training "
             f"tokens per run, seeds {', '.join(map(str, report['seeds']))}", "",
             "| model | experts | ops/timestep | params (no emb./softmax) | test ppl | first-pass ppl | train ppl | "
             "tokens/s | TFLOPS/device | speed vs dense | runs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["rows"]:
        runs = " ".join(f"[s{s}]({v['run']})" for s, v in r["seeds"].items())
        target = "" if "speed_target" not in r else (" ✓" if r["meets_speed_target"] else f" (< {r['speed_target']})")
        lines.append(f"| {r['model']} | {r['experts'] or '-'} | {r['ops_per_timestep']:,} | "
                     f"{r['params_excluding_embedding_softmax']:,} | {_pm(r['test_ppl'])} | "
                     f"{_pm(r['first_pass_ppl']) if r['first_pass_ppl'] else '-'} | {_pm(r['train_ppl'])} | "
                     f"{_pm(r['tokens_per_s'], 0)} | {_pm(r['tflops_per_device'], 4)} | "
                     f"{r['speed_vs_dense']:.2f}{target} | {runs} |")
    lines += ["", "± is half the spread over the seeds. Perplexity is per word; test = the held-out test split after "
              "training; first pass = the training loss on text not seen yet (the second half of the first epoch); "
              "train = the training perplexity at the end.",
              "![perplexity](capacity_ppl.png) ![speed](capacity_speed.png)", ""]
    return "\n".join(lines)


def plots(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    dense = next(r for r in rows if r["model"] == DENSE)   # every sweep trains the baseline
    panels = [("test_ppl", "test (held out)", "o", "C0"),
              ("first_pass_ppl", "first pass (text not seen yet)", "^", "C2"),
              ("train_ppl", "training (end)", "s", "C1")]
    panels = [panel for panel in panels if all(r[panel[0]] for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5))   # each on its own scale
    for ax, (key, label, marker, color) in zip(axes, panels):
        x = [r["params_excluding_embedding_softmax"] for r in rows]
        y = [r[key]["mean"] for r in rows]
        err = [[r[key]["mean"] - r[key]["min"] for r in rows], [r[key]["max"] - r[key]["mean"] for r in rows]]
        ax.errorbar(x, y, yerr=err, fmt=marker, capsize=3, color=color)
        for i, (r, xi, yi) in enumerate(zip(rows, x, y)):
            ax.annotate(r["model"], (xi, yi), textcoords="offset points", xytext=(5, 6 if i % 2 else -11), fontsize=7)
        ax.axhline(dense[key]["mean"], color="gray", linestyle="--", linewidth=0.8, label="dense (lstm-ffn-lstm)")
        ax.legend(loc="best", fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("parameters excluding embedding and softmax (log)")
        ax.set_ylabel("perplexity per word")
        ax.set_title(label)
    seeds = len(rows[0]["seeds"]) if rows and "seeds" in rows[0] else 0
    fig.suptitle(f"equal ops/timestep ({rows[0]['ops_per_timestep']:,}), {report['tokens_per_run']:,} tokens per run"
                 + (f", bars: min-max over {seeds} seeds" if seeds > 1 else ""))
    fig.tight_layout()
    fig.savefig(out / "capacity_ppl.png", dpi=100)
    plt.close(fig)

    moe = [r for r in rows if r["experts"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "tflops_per_device", "TFLOPS/device")):
        for label_, fmt, series in (("flat MoE", "o-", [r for r in moe if not r["model"].endswith("-h")]),
                                    ("hierarchical MoE", "s-", [r for r in moe if r["model"].endswith("-h")])):
            if series:
                ax.errorbar([r["experts"] for r in series], [r[key]["mean"] for r in series],
                            yerr=[[r[key]["mean"] - r[key]["min"] for r in series],
                                  [r[key]["max"] - r[key]["mean"] for r in series]], fmt=fmt, capsize=3, label=label_)
        for r in moe:
            if r["processes"] > 1:
                ax.annotate(f"{r['processes']} processes", (r["experts"], r[key]["mean"]), textcoords="offset points",
                            xytext=(-30, 8), fontsize=7)
        ax.axhline(dense[key]["mean"], color="gray", linestyle="--", label="dense (lstm-ffn-lstm)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("experts")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "capacity_speed.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = sweep(args)
    except RuntimeError as e:
        print(f"capacity_sweep.py: error: {e}", file=sys.stderr)
        return 1
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
