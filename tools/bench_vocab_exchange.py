#!/usr/bin/env python
"""Bytes exchanged and step time with the vocabulary tables whole on every rank (--vocab-exchange dense: their
gradients all-reduced) against split by rows (rows: each batch's rows and hidden states exchanged), on P gloo
processes, with an lm1b-like vocabulary, in one run (models/vocab_parallel.py;
docs/scale-paper.md#the-vocabulary-tables).

    python tools/bench_vocab_exchange.py --out bench_vocab.json                 # 2 and 4 processes, 200,000 words
    python tools/bench_vocab_exchange.py --procs 2 --types 20000 --words 200000 --max-steps 12

The corpus is generated (--seed): --words tokens drawn from a Zipf law (exponent 1) over --types word types,
plus every type once, so that the vocabulary holds all --types words (the 1B-word benchmark's 793,471 are the
words seen 3 times or more of 0.8 billion: mostly rare ones). Each run is the README's multi-process command,
`deepspeed --num_gpus P --module moe_scale train --ep-size P --ds-config ds_configs/zero2_ep.json`, LSTM-MoE at
--d-model with --softmax sampled (min(1024, --types / 4) samples: the compute per token does not depend on the
vocabulary), through
tools/comm_bytes.py, which counts what each rank sends in every collective (by the collectives' usual algorithms:
ring all-reduce 2(n-1)/n of the tensor, all-gather and reduce-scatter (n-1)/n of the whole, an all-to-all what goes
to the other ranks) between the starts of consecutive optimizer steps. Per run the JSON holds the median bytes a
rank sends in a step, by collective, the rows of the tables the step touched (the distinct ids the ranks fetched,
summed over the ranks: what a row-sparse exchange would send at the least) and the bytes of the split tables' own
exchanges (the "vocabulary:" collectives; the rest is the model's other traffic), the run's step seconds and tokens/s
(its summary: the steps after the warm-up) and the largest resident memory of a rank; per process count the ratios
dense / rows. Exit status: 0 done; 1 a run failed or was killed; 2 a bad flag.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from json_lines import emit_report
from tool_args import OneLineParser, check_out_file, positive_int, positive_int_list

REPO = Path(__file__).resolve().parents[1]
DS_CONFIG = "ds_configs/zero2_ep.json"
MODES = ("dense", "rows")


def parse_args(argv: list[str]):
    parser = OneLineParser(prog="bench_vocab_exchange.py", description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=positive_int_list, default=[2, 4], help="process counts, comma-separated "
                                                                                "(each ≥ 2)")
    parser.add_argument("--types", type=positive_int, default=200_000, help="word types (the vocabulary)")
    parser.add_argument("--words", type=positive_int, default=1_500_000, help="Zipf-drawn training tokens")
    parser.add_argument("--d-model", type=positive_int, default=128, help="model width")
    parser.add_argument("--max-steps", type=positive_int, default=30, help="training steps per run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the corpus")
    parser.add_argument("--timeout", type=positive_int, default=900, help="seconds a run may take (exit 1)")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    if any(p < 2 for p in args.procs):
        parser.error("--procs: every count must be at least 2 (one process splits nothing)")
    if args.max_steps < 6:
        parser.error("--max-steps must be at least 6: the first steps warm up")
    if args.types < 1000:
        parser.error("--types must be at least 1000 for an lm1b-like vocabulary")
    check_out_file(parser, args.out)
    return args


def write_corpus(directory: Path, types: int, words: int, seed: int) -> None:
    """train.txt (Zipf draws plus every type once, 50 words a line), valid.txt and test.txt (Zipf draws)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, types + 1, dtype=torch.float64)

    def draw(n: int) -> torch.Tensor:
        return torch.multinomial(p, n, replacement=True, generator=g)

    train = torch.cat([draw(words), torch.arange(types)])
    train = train[torch.randperm(train.numel(), generator=g)]
    directory.mkdir(parents=True, exist_ok=True)
    for name, ids in (("train.txt", train), ("valid.txt", draw(20_000)), ("test.txt", draw(20_000))):
        tokens = [f"w{i}" for i in ids.tolist()]
        lines = (" ".join(tokens[i:i + 50]) for i in range(0, len(tokens), 50))
        (directory / name).write_text("\n".join(lines) + "\n")


def run_one(work: Path, data: Path, procs: int, mode: str, args) -> dict:
    out = work / f"p{procs}_{mode}"
    counts = work / f"bytes_p{procs}_{mode}"
    command = ["deepspeed", "--log_level", "warning", "--num_gpus", str(procs),
               "--master_port", str(_free_port()), str(REPO / "tools" / "comm_bytes.py"), str(counts), "train",
               "--data", str(data), "--vocab-size", str(args.types + 3), "--d-model", str(args.d_model),
               "--expert-hidden", str(args.d_model), "--num-experts", "8", "--top-k", "2", "--seq-len", "32",
               "--batch-size", str(16 * procs), "--softmax", "sampled", "--num-sampled", str(samples(args)),
               "--ep-size", str(procs), "--vocab-exchange", mode, "--ds-config", DS_CONFIG,
               "--max-steps", str(args.max_steps), "--log-interval", str(args.max_steps), "--eval-interval",
               "1000000", "--eval-max-batches", "1", "--checkpoint-interval", "0", "--out", str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{procs} processes, --vocab-exchange {mode}: exit {proc.returncode}\n"
                           + proc.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    ranks = [json.loads(path.read_text()) for path in sorted(counts.glob("rank*.json"))]
    steps = [step for rank in ranks for step in rank["steps"][3:]]   # after the warm-up
    kinds = sorted({kind for step in steps for kind in step["bytes"]})
    per_kind = {kind: statistics.median(step["bytes"].get(kind, 0) for step in steps) for kind in kinds}
    rows = [sum(rank["steps"][i]["rows_fetched"] for rank in ranks) for i in range(3, len(ranks[0]["steps"]))]
    vocabulary = sum(v for k, v in per_kind.items() if k.startswith("vocabulary:"))
    return {"procs": procs, "mode": mode, "bytes_per_rank_per_step": sum(per_kind.values()),
            "bytes_by_collective": per_kind, "vocabulary_bytes_per_rank_per_step": vocabulary,
            "rows_touched_per_step": statistics.median(rows) if rows else 0,
            "step_seconds": summary["step_seconds"], "tokens_per_s": summary["tokens_per_s"],
            "peak_rss_mib_per_process": summary.get("peak_rss_mib_per_process")}


def samples(args) -> int:
    return min(1024, args.types // 4)


def _free_port() -> int:
    sys.path.insert(0, str(REPO))
    from moe_scale.distributed.ports import free_port

    return free_port()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    runs, ratios = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_vocab_") as tmp:
        work = Path(tmp)
        write_corpus(work / "corpus", args.types, args.words, args.seed)
        try:
            for procs in args.procs:
                pair = {mode: run_one(work, work / "corpus" / "train.txt", procs, mode, args) for mode in MODES}
                runs += pair.values()
                dense, rows = pair["dense"], pair["rows"]
                ratios[str(procs)] = {
                    "bytes_dense_over_rows": dense["bytes_per_rank_per_step"] / rows["bytes_per_rank_per_step"],
                    "step_seconds_dense_over_rows": dense["step_seconds"] / rows["step_seconds"],
                    "vocabulary_bytes_over_touched_rows_bytes": rows["vocabulary_bytes_per_rank_per_step"] * procs
                    / max(1, rows["rows_touched_per_step"] * args.d_model * 4)}
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"bench_vocab_exchange.py: {e}", file=sys.stderr)
            return 1
    result = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count()},
              "settings": {"types": args.types, "words": args.words, "d_model": args.d_model,
                           "max_steps": args.max_steps, "seed": args.seed, "ds_config": DS_CONFIG,
                           "num_sampled": samples(args)},
              "runs": runs, "ratios": ratios}
    emit_report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
