"""The `moe-scale` command: one module per subcommand in moe_scale/commands/.

    moe-scale train [--config FILE] [--num-experts 16 --top-k 2 ...]
    moe-scale eval --run DIR [--split valid|test] [--data PATH] [--json]
    moe-scale flops --preset NAME [--json]        moe-scale plan --preset NAME --nodes N ...
    moe-scale generate --run DIR [--prompt TEXT] [--greedy | --temperature T --top-k K --top-p P]
    moe-scale export --run DIR --format hf --out DIR
    moe-scale prune-heads --run DIR [--data PATH] [--steps 10]

Errors a user can cause print one line `moe-scale: error: ...` and exit with status 2. SIGINT (Ctrl-C) and SIGTERM
end a command with one line and status 130 / 143, nothing half-written (moe_scale/interrupts.py; training first
finishes its step and writes a checkpoint, then exits 0: train/preemption.py).
"""

from __future__ import annotations

import argparse
import os
import sys

from moe_scale.errors import UserError
from moe_scale.interrupts import Interrupted, interrupted_line, signals_end_the_command


def commands() -> tuple:
    """The subcommands' modules, imported once the command's signal handlers are in place (torch and the rest
    take seconds to import: a Ctrl-C then is one line too)."""
    from moe_scale.commands import eval as eval_command
    from moe_scale.commands import export, flops, generate, plan, prune_heads, train

    return train, eval_command, generate, export, flops, plan, prune_heads


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-scale",
        description="Train sparsely-gated mixture-of-experts language models (Shazeer et al. 2017; MoA, MAE) on "
                    "DeepSpeed, from one CPU to GPU clusters; evaluate them and sample text from them; count their "
                    "FLOPs and plan their memory.")
    # The deepspeed launcher puts --local_rank=N before the subcommand; LOCAL_RANK is what we use.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands():
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        with signals_end_the_command():
            _run(argv)
    except UserError as e:
        print(f"moe-scale: error: {e}", file=sys.stderr)
        return 2
    except (Interrupted, KeyboardInterrupt) as e:
        line, status = interrupted_line(e)
        print(line, file=sys.stderr)
        return status
    except BrokenPipeError:   # the reader of stdout went away (`| head`): stop as `cat` does, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13   # SIGPIPE's conventional status
    return 0


def _run(argv: list[str] | None) -> None:
    from moe_scale.console import drop_library_notices
    from moe_scale.distributed.launch import select_accelerator, shutdown_distributed
    from moe_scale.distributed.threads import apply_thread_share
    from moe_scale.host_memory import apply_process_settings

    apply_process_settings()   # process-wide memory settings: here, never on import
    args = build_parser().parse_args(argv)
    apply_thread_share(say=getattr(args, "computes", True))   # before the command's first torch op
    drop_library_notices()
    select_accelerator()   # before anything imports deepspeed
    args.run_command(args)
    shutdown_distributed()   # only after success: a rank that failed alone must not wait in a barrier


if __name__ == "__main__":
    sys.exit(main())
