#!/usr/bin/env python
"""Shazeer et al. 2017, Table 6 in small: the balancing losses' weights against expert balance and perplexity.

For each (w_importance, w_load) of the paper's Table 6, in the paper's order,

    (0, 0)  (0.2, 0)  (0, 0.2)  (0.1, 0.1)  (0.01, 0.01)  (1, 1)

trains the LSTM-MoE with `python -m moe_scale train` (one subprocess and one run directory per row under
--out) on WikiText-2: train on valid.txt, validate and test on test.txt (only those two splits are
shipped; ../shared/data/wikitext-2 beside the repository, or --wikitext DIR). Everything but the two
weights is the same in every row (the seed included), so the rows differ only by the balancing losses.

The metrics come from each run's summary.json:
  valid_ppl            perplexity on test.txt (passed as --valid-data) at the end of training
  cv_importance        CV (coefficient of variation, not CV^2; population std) of Importance,
  cv_load              CV of Load (the paper's smooth estimator: summary.json cv_router_load) and
  max_over_mean_load   max(Load)/mean(Load) (summary.json max_over_mean_router_load), each over the steps of
                       the last logging interval of training (the vectors summed over its steps).

Outputs in --out: table6.md (caption + Markdown table, also printed on stdout), table6.json (the rows),
runs/row<i>_wi<w_importance>_wl<w_load>/ (the run directories), logs/row<i>.{stdout,stderr}.
Progress goes to stderr.

    python tools/table6.py --out runs/table6                       # all six rows, defaults (~15 min on 2 cores)
    python tools/table6.py --out runs/t6 --only 0,3 --max-steps 3 --extra --d-model 16 --seq-len 8

--extra takes the rest of the command line and passes it to `moe-scale train` after the tool's own
defaults (so e.g. --extra --d-model 32 overrides the default width). The flags the tool sets per row or
has its own flag for (--w-importance, --w-load, --num-experts, --top-k, --max-steps, --out, --data,
--valid-data, --test-data, ...) are refused there. Each run gets OMP_NUM_THREADS=--threads (default 1).

Exit status: 0 done; 1 a training run failed (the row and the tail of its stderr are printed);
2 a bad flag (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tool_args import OneLineParser, positive_int

from moe_scale.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2"

# The paper's Table 6 rows, in its order: (w_importance, w_load).
ROWS = [(0.0, 0.0), (0.2, 0.0), (0.0, 0.2), (0.1, 0.1), (0.01, 0.01), (1.0, 1.0)]

# Model and training settings shared by every row (before --extra, which may override them). Chosen so
# the six default runs take about 10-15 minutes on 2 shared CPU cores (about 2000 tokens/s per run, plus
# about 20 s of start-up each). lr 0.03: at lr 0.01 and 150 steps the no-loss row reached only CV(Load)
# 0.78, max/mean 4.1 (the zero-initialised router drifts slowly); at 0.03 it passes CV(Load) 1 by step 90.
DEFAULT_TRAIN_FLAGS = [
    "--d-model", "64", "--expert-hidden", "32", "--vocab-size", "2000",
    "--batch-size", "32", "--seq-len", "16", "--lr", "0.03", "--warmup-steps", "20",
    "--eval-max-batches", "20", "--seed", "1234",
]
DEFAULT_NUM_EXPERTS = 256
DEFAULT_TOP_K = 4
DEFAULT_MAX_STEPS = 600

# Flags --extra may not set: the tool sets them per row, or has its own flag for them.
OWNED_FLAGS = {"--w-importance", "--w-load", "--num-experts", "--top-k", "--max-steps", "--out", "--data",
               "--valid-data", "--test-data", "--resume", "--no-resume", "--overwrite", "--no-overwrite",
               "--config"}

STDERR_TAIL_LINES = 25



def _fail(message: str) -> None:
    print(f"table6.py: error: {message}", file=sys.stderr)
    sys.exit(2)



def _row_list(text: str) -> list[int]:
    parts = text.split(",")
    try:
        rows = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row numbers 0-{len(ROWS) - 1}, "
                                         f"got {text!r}") from None
    bad = [r for r in rows if not 0 <= r < len(ROWS)]
    if bad:
        raise argparse.ArgumentTypeError(f"row {bad[0]} does not exist; rows are 0-{len(ROWS) - 1}")
    if len(set(rows)) != len(rows):
        raise argparse.ArgumentTypeError(f"a row is given twice in {text!r}")
    return sorted(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="table6.py", description="Shazeer et al. 2017 Table 6 in small (see the module docstring).")
    p.add_argument("--out", required=True, type=Path, help="output directory (runs, logs, table6.md, table6.json)")
    p.add_argument("--wikitext", type=Path, default=DEFAULT_WIKITEXT,
                   help=f"directory with WikiText-2 valid.txt and test.txt (default: {DEFAULT_WIKITEXT})")
    p.add_argument("--num-experts", type=positive_int, default=DEFAULT_NUM_EXPERTS,
                   help=f"experts in the MoE layer, 64-256 (default: {DEFAULT_NUM_EXPERTS})")
    p.add_argument("--top-k", type=positive_int, default=DEFAULT_TOP_K,
                   help=f"experts per token (default: {DEFAULT_TOP_K}, the paper's flat MoE)")
    p.add_argument("--max-steps", type=positive_int, default=DEFAULT_MAX_STEPS,
                   help=f"training steps per row (default: {DEFAULT_MAX_STEPS})")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads per training run (OMP_NUM_THREADS; default 1: on a shared 2-core machine "
                        "2 threads ran 10x slower than 1 when other processes competed)")
    p.add_argument("--only", type=_row_list, default=None,
                   help="comma-separated rows to run, 0-5 in the paper's order (default: all)")
    p.add_argument("--reuse", action="store_true", help="skip rows whose run directory already has summary.json")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="everything after it goes to `moe-scale train` (must come last)")
    args = p.parse_args(argv)

    if not 64 <= args.num_experts <= 256:
        _fail(f"--num-experts {args.num_experts}: allowed 64-256 (Table 6 is about many experts)")
    if args.top_k > args.num_experts:
        _fail(f"--top-k {args.top_k}: larger than --num-experts {args.num_experts}")
    for flag in args.extra:
        name = flag.split("=", 1)[0]
        if name in OWNED_FLAGS:
            _fail(f"--extra {name}: set by table6.py itself; use its own flag or drop it")
    for split in ("valid.txt", "test.txt"):
        if not (args.wikitext / split).is_file():
            _fail(f"--wikitext {args.wikitext}: no {split} there; point --wikitext at the WikiText-2 directory")
    if args.out.exists() and not args.out.is_dir():
        _fail(f"--out {args.out}: is a file, not a directory; choose another --out")
    args.rows = args.only if args.only is not None else list(range(len(ROWS)))
    return args


def _fmt_w(w: float) -> str:
    return f"{w:g}"


def run_dir_name(i: int) -> str:
    wi, wl = ROWS[i]
    return f"row{i}_wi{_fmt_w(wi)}_wl{_fmt_w(wl)}"


def train_command(args: argparse.Namespace, i: int, run: Path) -> list[str]:
    wi, wl = ROWS[i]
    steps = args.max_steps
    log_interval = max(1, steps // 10)   # metrics = means over the last 10% of training
    return [sys.executable, "-m", "moe_scale", "train",
            "--data", str(args.wikitext / "valid.txt"),
            "--valid-data", str(args.wikitext / "test.txt"), "--test-data", str(args.wikitext / "test.txt"),
            "--num-experts", str(args.num_experts), "--top-k", str(args.top_k), "--max-steps", str(steps),
            "--log-interval", str(log_interval), "--eval-interval", str(steps),
            "--checkpoint-interval", str(steps),
            *DEFAULT_TRAIN_FLAGS, *args.extra,
            "--w-importance", repr(wi), "--w-load", repr(wl), "--out", str(run), "--overwrite"]


def run_row(args: argparse.Namespace, i: int) -> float:
    """Trains row i unless --reuse finds its summary; returns the wall seconds spent (0 when reused)."""
    run = args.out / "runs" / run_dir_name(i)
    wi, wl = ROWS[i]
    if args.reuse and (run / "summary.json").is_file():
        print(f"[table6] row {i} (w_importance={_fmt_w(wi)}, w_load={_fmt_w(wl)}): reusing {run}", file=sys.stderr)
        return 0.0
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = train_command(args, i, run)
    print(f"[table6] row {i} (w_importance={_fmt_w(wi)}, w_load={_fmt_w(wl)}): training {run}", file=sys.stderr)
    began = time.perf_counter()
    with open(logs / f"row{i}.stdout", "w") as out, open(logs / f"row{i}.stderr", "w") as err:
        proc = subprocess.run(cmd, stdout=out, stderr=err, cwd=REPO,
                              env={**os.environ, "PYTHONUNBUFFERED": "1",
                                   "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)})
    seconds = time.perf_counter() - began
    if proc.returncode != 0 or not (run / "summary.json").is_file():
        tail = (logs / f"row{i}.stderr").read_text(errors="replace").splitlines()[-STDERR_TAIL_LINES:]
        print(f"table6.py: row {i} (w_importance={_fmt_w(wi)}, w_load={_fmt_w(wl)}) failed "
              f"(exit status {proc.returncode}); last lines of {logs / f'row{i}.stderr'}:", file=sys.stderr)
        for line in tail:
            print(f"  {line}", file=sys.stderr)
        sys.exit(1)
    print(f"[table6] row {i}: done in {seconds:.0f} s", file=sys.stderr)
    return seconds


def _param_line(args: argparse.Namespace, i: int) -> str | None:
    """'1.23M parameters (0.52M in 64 experts)' from the run's stdout, when the log is still there."""
    log = args.out / "logs" / f"row{i}.stdout"
    if not log.is_file():
        return None
    match = re.search(r"training (.+? parameters \(.+? in \d+ experts\))", log.read_text(errors="replace"))
    return match.group(1) if match else None


def collect(args: argparse.Namespace) -> dict:
    rows, configs = [], []
    for i in args.rows:
        run = args.out / "runs" / run_dir_name(i)
        summary = json.loads((run / "summary.json").read_text())
        config = json.loads((run / "config.json").read_text())
        configs.append(config)
        wi, wl = ROWS[i]
        rows.append({"row": i, "w_importance": wi, "w_load": wl,
                     "valid_ppl": summary["valid_ppl"], "cv_importance": summary["cv_importance"],
                     "cv_load": summary["cv_router_load"],
                     "max_over_mean_load": summary["max_over_mean_router_load"],
                     "train_ppl": summary.get("train_ppl"), "steps": summary.get("steps"),
                     "run_dir": str(run)})
    config = RunConfig.from_dict(configs[0], "config.json")
    m, d, t = config.model, config.data, config.train
    experts, router = config.moe.experts, config.moe.router
    tokens = t.max_steps * t.batch_size * d.seq_len
    params = _param_line(args, args.rows[0])
    caption = (
        f"Table 6 in small: LSTM-MoE (d_model {m.d_model}, {experts.num_experts} experts of hidden "
        f"{experts.hidden}, k={router.top_k}, vocabulary {d.vocab_size}"
        + (f"; {params}" if params else "") + f"), "
        f"{t.max_steps} steps of {t.batch_size}x{d.seq_len} tokens = {tokens:,} training tokens "
        f"of WikiText-2 valid.txt, lr {t.lr}, seed {t.seed}. Valid PPL: perplexity on WikiText-2 test.txt "
        f"after training (summary.json valid_ppl). CV(Importance), CV(Load) (coefficient of variation, not "
        f"squared; smooth load estimator) and max(Load)/mean(Load): summary.json cv_importance, cv_router_load, "
        f"max_over_mean_router_load, over the last logging interval of training (the last "
        f"{config.run.log_interval} steps). Paper (MoE-256, 1B words): CVs 3.04/3.01 and max/mean 17.80 without "
        f"losses.")
    return {"caption": caption, "tokens": tokens, "config": configs[0], "rows": rows}


def _num(x, digits: int) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown(table: dict) -> str:
    lines = [table["caption"], "",
             "| w_importance | w_load | Valid PPL | CV(Importance) | CV(Load) | max(Load)/mean(Load) |",
             "|---|---|---|---|---|---|"]
    for r in table["rows"]:
        lines.append(f"| {r['w_importance']:.2f} | {r['w_load']:.2f} | {_num(r['valid_ppl'], 1)} | "
                     f"{_num(r['cv_importance'], 2)} | {_num(r['cv_load'], 2)} | {_num(r['max_over_mean_load'], 2)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _fail(f"--out {args.out}: cannot create it ({exc.strerror}); choose another --out")
    began = time.perf_counter()
    for i in args.rows:
        run_row(args, i)
    table = collect(args)
    table["wall_seconds"] = round(time.perf_counter() - began, 1)
    text = markdown(table)
    (args.out / "table6.md").write_text(text)
    (args.out / "table6.json").write_text(json.dumps(table, indent=2) + "\n")
    print(text, end="")
    print(f"[table6] {len(args.rows)} row(s) in {table['wall_seconds']:.0f} s; wrote {args.out / 'table6.md'} "
          f"and {args.out / 'table6.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
