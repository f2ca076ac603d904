"""`moe-scale eval`: per-word perplexity of a trained run on a split or on other text, and on request the
expert-utilisation statistics and top tokens per expert of every MoE layer."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from moe_scale.commands.help_format import HelpFormatter
from moe_scale.commands.run_flags import add_run_flags
from moe_scale.config import RunConfig
from moe_scale.errors import UserError
from moe_scale.run_files import RunFiles


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity of a trained run on a split or on other text",
                       description="Per-word perplexity of a trained run on its validation or test split, or on "
                                   "other text; with --expert-stats the load and importance of every MoE layer's "
                                   "experts, with --top-tokens what each expert is given.",
                       formatter_class=HelpFormatter)
    add_run_flags(p, "evaluate")
    p.add_argument("--split", choices=("valid", "test"), default="valid", help="the run's split to evaluate")
    p.add_argument("--data", metavar="PATH", help="evaluate on this text instead (file, dir or glob)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--expert-stats", action="store_true", help="per MoE layer: load and importance per "
                   "expert, CV and max/mean load over the evaluated text")
    p.add_argument("--record-routes", metavar="DIR", help="write each routed layer's chosen experts per token to "
                                                          "DIR (router replay: docs/routing.md)")
    p.add_argument("--replay-routes", metavar="DIR", help="route by the experts recorded in DIR (eval "
                                                          "--record-routes of the same run and data), the gates "
                                                          "from the live router")
    p.add_argument("--top-tokens", type=int, default=0, metavar="N", help="per expert: the N positions with "
                   "the largest gate (with context) and the N words routed there most often")
    p.set_defaults(run_command=run)


def run(args: argparse.Namespace) -> None:
    with contextlib.redirect_stdout(sys.stderr):   # only the result on stdout (`--json` must parse)
        result = run_eval(args.run, args.split, args.data, args.expert_stats, args.top_tokens, args.checkpoint,
                          args.record_routes, args.replay_routes)
    if result is not None:
        print(json.dumps(result) if args.json else format_eval(result))


def check_expert_stats_world(config, world_size: int) -> None:
    """The hierarchical gate picks a token's experts on the rank that holds them, among rows from every rank: its
    pairs name that rank's rows, not the token's position, so its per-expert report is made in one process."""
    from moe_scale.moe.router import gate_class

    if world_size > 1 and config.has_moe_ffn and gate_class(config.moe.router).expert_stats_in_one_process:
        raise UserError(f"--expert-stats/--top-tokens with the hierarchical gate runs in one process (its experts "
                        f"pick among rows from every rank; this launch has {world_size}): start eval without a "
                        f"launcher")


def run_eval(run_dir: str, split: str, data: str | None, expert_stats: bool = False,
             top_tokens: int = 0, checkpoint: str | None = None, record_routes: str | None = None,
             replay_routes: str | None = None) -> dict | None:
    """Evaluates checkpoint `checkpoint` (default: the newest complete one) on every process of the launch (the
    experts spread over them); returns the result on rank 0 (None elsewhere)."""
    from moe_scale.data import load_sentences, resolve_text_files, sentence_texts
    from moe_scale.data.eval_windows import EvalWindows
    import zlib

    from moe_scale.inference.trained_run import open_trained_run
    from moe_scale.moe.route_tape import open_tape
    from moe_scale.train.data_setup import load_run_splits
    from moe_scale.train.evaluate import evaluate
    from moe_scale.train.expert_tokens import ExpertTokenStats

    if top_tokens < 0:
        raise UserError(f"--top-tokens must be 0 or more (got {top_tokens})")
    files = resolve_text_files(data, "--data") if data is not None else None
    run = Path(run_dir)
    trained = open_trained_run(run, checkpoint, "eval", experts_over_processes=True)
    config, vocab, model, env, tag = trained.config, trained.tokenizer, trained.model, trained.env, trained.checkpoint
    if expert_stats or top_tokens:
        check_expert_stats_world(config, env.world_size)
    if files is not None:
        sentences, source = load_sentences(files), [str(f) for f in files]
    else:
        _, valid, test = load_run_splits(config.data)
        sentences, source = (valid if split == "valid" else test), split_source(config, split)
    rows = config.train.batch_size if config.train.batch_size % env.world_size == 0 else env.world_size
    windows = EvalWindows(sentence_texts(sentences), vocab, seq_len=config.data.seq_len, global_rows=rows,
                          rank=env.rank, world_size=env.world_size, what=f"the {split} data")
    observer = ExpertTokenStats(model.moe_layers(), vocab, windows.tokens, top_tokens) \
        if expert_stats or top_tokens else None
    tape = open_tape(model.moe_layers(), config.moe.router.gate, record_routes, replay_routes, env.rank,
                     env.world_size, {"tokens_crc32": zlib.crc32(windows.tokens.tobytes()),
                                      "seq_len": config.data.seq_len, "rows": rows})
    result = evaluate(model, windows, device=env.device, observer=observer, describe=True, tape=tape)
    result = {"split": "data" if data else split, "source": source, "checkpoint": tag,
              "tokenizer": config.data.tokenizer, **result}
    if observer is not None:
        result["expert_stats"] = observer.report()
        observer.close()
        if env.rank == 0 and expert_stats:
            from moe_scale.metrics.plots import write_expert_stats_plot

            name = f"eval_{result['split']}_{tag}_experts.png"
            plot = RunFiles(run).plots / name
            try:
                result["expert_stats_plot"] = str(write_expert_stats_plot(result["expert_stats"], plot))
            except OSError as e:   # a read-only run directory: the numbers still come out
                print(f"moe-scale: warning: {plot} not written ({e.strerror or e})", file=sys.stderr)
    return result if env.rank == 0 else None


def split_source(config: RunConfig, split: str) -> list[str] | str:
    """Which files a split came from (so a report never hides that it used a held-out part of train)."""
    from moe_scale.data import resolve_text_files, split_files

    given = config.data.valid_data if split == "valid" else config.data.test_data
    if given:
        return [str(f) for f in resolve_text_files(given, f"--{split}-data")]
    files = split_files(config.data.data)[split]
    return [str(f) for f in files] if files else f"held out from the end of the training text ({config.data.data})"


def format_eval(result: dict) -> str:
    from moe_scale.train.expert_tokens import format_expert_report

    lines = []
    for key, value in result.items():
        if key == "expert_stats":
            continue
        if isinstance(value, list):
            value = ", ".join(value)
        lines.append(f"{key:<22} {value:.4f}" if isinstance(value, float) else f"{key:<22} {value}")
    if "expert_stats" in result:
        top_n = max((len(e.get("top_by_gate", [])) for s in result["expert_stats"].values()
                     for e in s["experts"]), default=0)
        lines.append(format_expert_report(result["expert_stats"], top_n))
    return "\n".join(lines)
