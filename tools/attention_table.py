#!/usr/bin/env python
"""MHA vs MoA vs MAE transformer LMs at matched size on WikiText-2: parameters, MACs per token, validation ppl.

Trains one `python -m moe_scale train --model transformer` per attention kind (a subprocess and a run
directory each, under --out/runs/<kind>) on WikiText-2 valid.txt, validating on test.txt (the two splits
shipped in ../shared/data/wikitext-2, or --wikitext DIR). Everything but the attention is the same in
every row (seed included). Default sizes (d_model 64, 2 layers, seq_len 32):

    mha  4 heads x 16                                    (attention width 64)
    moa  E=8 attention experts of width 16, k=4 per token (eq. 18: 25% fewer attention MACs than MHA)
    mae  4 heads x 16 and the gate (its G steps on one step in 5, `--mae-g-unit step`; the short run
         never reaches a second epoch, so the paper's one-epoch-in-five would train the gate in epoch 0 only)

Columns: params (every parameter, experts counted once over all ranks), attention params (all layers),
forward MACs per token (whole model and attention only; the paper's convention: one T² term, full T),
valid_ppl (exp mean NLL over test.txt at the end), unigram_ppl (the same split under the training unigram).

Outputs: --out/attention_table.md (also printed) and --out/attention_table.json; logs in --out/logs.

    python tools/attention_table.py --out runs/attention_table                 # ~10 min on 2 cores
    python tools/attention_table.py --out runs/at --max-steps 5 --only mha     # a smoke run
    python tools/attention_table.py --out runs/attention_table --reuse        # retrain only missing rows

Exit status: 0 done; 1 a training run failed (its stderr tail is printed); 2 a bad flag (one line).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tool_args import OneLineParser, non_negative_int, positive_int

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2"

COMMON = ["--model", "transformer", "--d-model", "64", "--num-layers", "2", "--ffn-hidden", "256",
          "--vocab-size", "5000", "--batch-size", "32", "--seq-len", "32", "--lr", "0.003", "--warmup-steps", "50",
          "--dropout", "0.1", "--log-interval", "50", "--seed", "1234"]
ROWS = {
    "mha": ["--attention", "mha", "--num-heads", "4", "--head-dim", "16"],
    "moa": ["--attention", "moa", "--moa-num-experts", "8", "--moa-top-k", "4", "--head-dim", "16"],
    "mae": ["--attention", "mae", "--num-heads", "4", "--head-dim", "16", "--mae-g-unit", "step",
            "--mae-g-every", "5"],
}


def parse_args():
    parser = OneLineParser(prog="attention_table.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=positive_int, default=400)
    parser.add_argument("--only", default="mha,moa,mae", help="comma-separated subset of mha,moa,mae")
    parser.add_argument("--wikitext", type=Path, default=DEFAULT_WIKITEXT)
    parser.add_argument("--eval-max-batches", type=non_negative_int, default=0,
                        help="cap on validation batches (0: all of test.txt, for the table)")
    parser.add_argument("--reuse", action="store_true", help="keep rows whose run already has a summary.json")
    args = parser.parse_args()
    args.only = [k.strip() for k in args.only.split(",") if k.strip()]
    bad = [k for k in args.only if k not in ROWS]
    if bad or not args.only:
        parser.error(f"--only: unknown kind(s) {bad}; choose from mha,moa,mae")
    for split in ("valid.txt", "test.txt"):
        if not (args.wikitext / split).is_file():
            parser.error(f"--wikitext {args.wikitext}: no {split} there; pass the WikiText-2 directory")
    return args


def train(args, kind: str) -> Path:
    run = args.out / "runs" / kind
    if args.reuse and (run / "summary.json").is_file():
        print(f"[attention_table] reusing {run}", file=sys.stderr)
        return run
    cmd = [sys.executable, "-m", "moe_scale", "train", *COMMON, *ROWS[kind], "--max-steps", str(args.max_steps),
           "--eval-interval", str(args.max_steps), "--eval-max-batches", str(args.eval_max_batches),
           "--checkpoint-interval", str(args.max_steps),
           "--data", str(args.wikitext / "valid.txt"), "--valid-data", str(args.wikitext / "test.txt"),
           "--test-data", str(args.wikitext / "test.txt"), "--out", str(run), "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"[attention_table] training {kind}: {' '.join(cmd[3:])}", file=sys.stderr)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (logs / f"{kind}.stdout").write_text(proc.stdout)
    (logs / f"{kind}.stderr").write_text(proc.stderr)
    if proc.returncode:
        print(f"[attention_table] {kind} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        sys.exit(1)
    return run


def measure(run: Path) -> dict:
    from moe_scale.config import RunConfig
    from moe_scale.data import Vocab
    from moe_scale.accounting.model_flops import forward_macs_per_token
    from moe_scale.models.build import build_model, parameter_counts

    config = RunConfig.load(run / "config.json")
    vocab_size = len(Vocab.load(run / "vocab"))
    model = build_model(config, vocab_size)
    attention_params = sum(p.numel() for block in model.blocks for p in block.attn.parameters())
    macs = forward_macs_per_token(config, vocab_size, config.data.seq_len)
    summary = json.loads((run / "summary.json").read_text())
    return {"params": parameter_counts(model)["total"], "attention_params": attention_params,
            "macs_per_token": sum(macs.values()), "attention_macs_per_token": macs["attention"],
            "valid_ppl": summary["valid_ppl"], "train_ppl": summary["train_ppl"],
            "unigram_ppl": summary["unigram_valid_ppl"], "tokens_per_s": summary["tokens_per_s"]}


def main() -> int:
    args = parse_args()
    rows = {kind: measure(train(args, kind)) for kind in args.only}
    header = "| attention | params | attention params | MACs/token | attention MACs/token | valid ppl | unigram ppl |"
    lines = [f"Transformer LMs on WikiText-2 (train valid.txt, validate test.txt), {args.max_steps} steps, "
             f"d_model 64, 2 layers, seq_len 32.", "", header, "|---|---|---|---|---|---|---|"]
    for kind, r in rows.items():
        lines.append(f"| {kind} | {r['params']:,} | {r['attention_params']:,} | {r['macs_per_token']:,} | "
                     f"{r['attention_macs_per_token']:,} | {r['valid_ppl']:.1f} | {r['unigram_ppl']:.1f} |")
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_table.md").write_text(table)
    (args.out / "attention_table.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
