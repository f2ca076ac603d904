"""The `moe-scale` command: one module per subcommand in moe_scale/commands/.

    moe-scale train [--config FILE] [--num-experts 16 --top-k 2 ...]
    moe-scale eval --run DIR [--split valid|test] [--data PATH] [--json]
    moe-scale flops --preset NAME [--json]        moe-scale plan --preset NAME --nodes N ...
    moe-scale generate --run DIR [--prompt TEXT] [--greedy | --temperature T --top-k K --top-p P]
    moe-scale export --run DIR --format hf --out DIR
    moe-scale prune-heads --run DIR [--data PATH] [--steps 10]

Errors a user can cause print one line `moe-scale: error: ...` and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from moe_scale.commands import eval as eval_command
from moe_scale.commands import export, flops, generate, plan, prune_heads, train
from moe_scale.console import drop_library_notices
from moe_scale.distributed.launch import select_accelerator, shutdown_distributed
from moe_scale.distributed.threads import apply_thread_share
from moe_scale.errors import UserError
from moe_scale.host_memory import apply_process_settings

COMMANDS = (train, eval_command, generate, export, flops, plan, prune_heads)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-scale",
        description="Train sparsely-gated mixture-of-experts language models (Shazeer et al. 2017; MoA, MAE) on "
                    "DeepSpeed, from one CPU to GPU clusters; evaluate them and sample text from them; count their "
                    "FLOPs and plan their memory.")
    # The deepspeed launcher puts --local_rank=N before the subcommand; LOCAL_RANK is what we use.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    apply_process_settings()   # process-wide memory settings: here, never on import
    args = build_parser().parse_args(argv)
    apply_thread_share()   # before the command's first torch op; logged by init_distributed
    drop_library_notices()
    select_accelerator()   # before anything imports deepspeed
    try:
        args.run_command(args)
    except UserError as e:
        print(f"moe-scale: error: {e}", file=sys.stderr)
        return 2
    shutdown_distributed()   # only after success: a rank that failed alone must not wait in a barrier
    return 0


if __name__ == "__main__":
    sys.exit(main())
