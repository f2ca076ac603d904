"""Host-blocking reads and kernel-launching operations of one regular training step, as a GPU dispatches them.

Runs `moe-scale train` on CPU with CUDA's decisions forced on (tools/step_syncs.py: the GPU's kernel
choices, and DeepSpeed on a simulated CUDA accelerator with streams and events, so ZeRO takes its CUDA paths) and
counts step 5 of 6 (after DeepSpeed's lazy set-up and the loop's timing warm-up; no log, eval or checkpoint point):
forward, backward, clipping, DeepSpeed's optimizer step and the loop's bookkeeping between log points.

One JSON line per rank:

    host_reads               reads that make the host wait for the device (the all-to-all's count reads apart)
    all_to_all_count_reads   the read of the counts an exchange needs: one per MoE layer where rows travel, and one
                             per vocabulary table split over several processes (its rows' exchange, or the full
                             softmax's gather); `all_to_all_count_reads_per_moe_layer` divides them all by the
                             MoE layers; none where nothing is exchanged
    kernel_ops               operations that launch work on a device
    phases                   the three by phase (forward, backward, clip, optimizer, loop), with each phase's most
                             frequent operations
    reads                    every read: phase, kind, file:line and function, count
    host_side_reads          reads of tensors that live on the host in a GPU run too (not counted), and why
    device_waits             a stream waiting for a stream or an event: the device waits, not the host (not counted)

The model is small in width (--d-model, --hidden): the counts depend on neither (tests/tools/test_step_syncs.py
checks it), only on the number of layers, experts, parameters and ranks. The default transformer is the GPU
check's shape (tools/gpu_check.sh: 8 MoE layers of 64 experts, k = 2) at d = 64, h = 128.

    python tools/count_step_syncs.py                                          # transformer, gpu_bf16_zero2, 1 rank
    python tools/count_step_syncs.py --model lstm --ranks 1,2 --ds-config ds_configs/gpu_bf16_zero1.json
    python tools/count_step_syncs.py --ranks 2 --dispatch capacity --vocab-exchange dense   # no read at all
    python tools/count_step_syncs.py --ranks 2 --a2a-chunks 4   # the reads of one piece

bf16 runs on CPU as it does on a GPU (DeepSpeed's bf16 ZeRO optimizer, torch's CPU bf16 kernels). 2 ranks: two
processes joined by gloo, expert-parallel over both (--ep-size 2). Results: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile
from pathlib import Path

os.environ["DS_ACCELERATOR"] = "cpu"   # the simulation runs on CPU tensors, whatever the machine has

import torch.multiprocessing as mp  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # a checkout without moe_scale installed
sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_lines import emit  # noqa: E402
from tool_args import OneLineParser, check_out_file, positive_int, positive_int_list  # noqa: E402

DEFAULT_DS_CONFIG = REPO / "ds_configs" / "gpu_bf16_zero2.json"
MODELS = ("transformer", "lstm")


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=MODELS, default="transformer")
    p.add_argument("--ds-config", type=Path, default=DEFAULT_DS_CONFIG, help="DeepSpeed JSON (default: %(default)s)")
    p.add_argument("--ranks", type=positive_int_list, default=[1], help="1, 2 or 1,2")
    p.add_argument("--layers", type=positive_int, default=8, help="transformer: blocks, each with an MoE layer")
    p.add_argument("--experts", type=positive_int, default=64, help="experts per MoE layer, over all ranks")
    p.add_argument("--k", type=positive_int, default=2, help="experts per token")
    p.add_argument("--d-model", type=positive_int, default=64)
    p.add_argument("--hidden", type=positive_int, default=128, help="expert hidden width")
    p.add_argument("--heads", type=positive_int, default=4, help="transformer: attention heads")
    p.add_argument("--seq-len", type=positive_int, default=32)
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step over all ranks")
    p.add_argument("--dispatch", choices=("dropless", "capacity"), default="dropless",
                   help="capacity: fixed-size slots, no count read (default: %(default)s)")
    p.add_argument("--a2a-chunks", type=positive_int, default=1,
                   help="each MoE layer's exchange in this many overlapped pieces (default: %(default)s)")
    p.add_argument("--vocab-exchange", choices=("rows", "dense"), default="rows",
                   help="2 ranks: the vocabulary tables split by rows (their exchanges read counts) or whole "
                        "(default: %(default)s)")
    p.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    check_out_file(p, args.out)
    if not args.ds_config.is_file():
        p.error(f"--ds-config {args.ds_config}: no such file; see ds_configs/")
    bad = sorted(set(args.ranks) - {1, 2})
    if bad:
        p.error(f"--ranks {','.join(map(str, bad))}: 1 and 2 are supported")
    if args.k > args.experts:
        p.error(f"--k {args.k} is larger than --experts {args.experts}")
    if 2 in args.ranks and (args.experts % 2 or args.batch_size % 2):
        p.error(f"--ranks 2 splits --experts ({args.experts}) and --batch-size ({args.batch_size}) over 2 ranks: "
                f"give even numbers")
    if args.model == "transformer" and args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    return args


def train_flags(args: argparse.Namespace, ranks: int) -> list[str]:
    """`moe-scale train` flags of the counted model (the run's length and points: step_syncs.run_flags)."""
    model = ["--model", "transformer", "--ffn", "moe", "--num-layers", str(args.layers), "--num-heads",
             str(args.heads)] if args.model == "transformer" else []
    return [*model, "--d-model", str(args.d_model), "--expert-hidden", str(args.hidden), "--num-experts",
            str(args.experts), "--top-k", str(args.k), "--seq-len", str(args.seq_len), "--batch-size",
            str(args.batch_size), "--dropout", "0.0", "--ep-size", str(ranks), "--dispatch", args.dispatch,
            "--a2a-chunks", str(args.a2a_chunks), "--vocab-exchange", args.vocab_exchange,
            "--ds-config", str(args.ds_config.resolve())]


def _rank(rank: int, port: int, flags: list[str], out: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_SIZE="2", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    from step_syncs import count_training

    try:
        results.put((rank, count_training(flags, Path(out))))
    except BaseException as e:   # noqa: BLE001 - reported by the parent, which stops the other rank
        results.put((rank, f"{type(e).__name__}: {e}"))
        raise


def count_two_ranks(flags: list[str], out: Path) -> list[dict]:
    """Both ranks' reports, rank 0 first."""
    from moe_scale.distributed.ports import free_port

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(rank, port, flags, str(out), results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    got: dict[int, dict] = {}
    try:
        while len(got) < 2:
            try:
                rank, report = results.get(timeout=5)
            except queue.Empty:
                failed = [proc.exitcode for proc in procs if proc.exitcode]
                if failed:
                    raise RuntimeError(f"a rank failed (exit code {failed[0]})")
                continue
            if isinstance(report, str):
                raise RuntimeError(f"rank {rank}: {report}")
            got[rank] = report
    finally:
        for proc in procs:
            if proc.is_alive() and len(got) < 2:
                proc.terminate()
            proc.join()
    return [got[0], got[1]]


def main(argv=None) -> int:
    args = parse_args(argv)
    moe_layers = args.layers if args.model == "transformer" else 1
    for ranks in args.ranks:
        flags = train_flags(args, ranks)
        with tempfile.TemporaryDirectory(prefix="count_step_syncs-") as tmp:
            if ranks == 1:
                from step_syncs import count_training

                reports = [count_training(flags, Path(tmp) / "run")]
            else:
                try:
                    reports = count_two_ranks(flags, Path(tmp) / "run")
                except RuntimeError as e:
                    print(f"count_step_syncs: {e}", file=sys.stderr)
                    return 1
        for rank, report in enumerate(reports):
            emit({"model": args.model, "ds_config": str(args.ds_config), "ranks": ranks, "rank": rank,
                  "moe_layers": moe_layers, "dispatch": args.dispatch, "a2a_chunks": args.a2a_chunks,
                  "vocab_exchange": args.vocab_exchange,
                  "experts": args.experts, "k": args.k, "d_model": args.d_model,
                  "hidden": args.hidden, "tokens_per_rank": args.batch_size * args.seq_len // ranks,
                  "host_reads": report["host_reads"], "all_to_all_count_reads": report["all_to_all_count_reads"],
                  "all_to_all_count_reads_per_moe_layer": report["all_to_all_count_reads"] / moe_layers,
                  "kernel_ops": report["kernel_ops"],
                  **{key: report[key] for key in ("phases", "reads", "host_side_reads", "device_waits")}}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
