"""Operations and host synchronisations of one MoE layer step (forward + backward), as a GPU dispatches them.

Runs on CPU with the GPU's kernel decisions (moe/kernel_policy.py: no native CPU kernels, the gate as whole
tensors, grouped GEMMs of at most 1,023 experts per call) and counts, with tools/op_count.py:

    ops                   aten operations dispatched
    kernel_ops            those that launch work on a GPU (ops less views and other metadata-only operations)
    host_syncs_forward    operations that make the host wait for the device, in the forward
    host_syncs_backward   the same in the backward
    grouped_gemm_calls    calls of the grouped GEMM (6 per 1,023 local experts: 2 forward, 4 backward)

for every combination of --experts (local experts per rank), --tokens (per rank), --k, --gates and --ranks
(2 ranks: two processes joined by gloo, expert-parallel over both; the larger count of the two is reported).
One JSON line per combination on stdout (and appended to --out). The layer is small in width (--d-model,
--hidden): counts depend on neither. The hierarchical gate picks k groups and 2 experts in each.

    python tools/count_ops.py                                  # the whole grid (about 2 minutes here)
    python tools/count_ops.py --experts 8,1024 --tokens 2048   # just those

Targets (the GPU path): the same count for every number of experts up to 1,023 and every number of tokens,
at most 400 operations per step, at most one host-blocking read in the forward and none in the backward.
Beyond 1,023 local experts each further 1,023 adds one call per product (see `grouped_gemm_calls`). Cases
whose gate tensors would not fit this machine's memory are reported as skipped. Results: docs/gpu-checks.md.
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import sys
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's moe_scale, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_lines import emit  # noqa: E402
from tool_args import OneLineParser, check_out_file, positive_int, positive_int_list  # noqa: E402

from moe_scale.distributed.ports import free_port  # noqa: E402

GATES = ("flat", "hierarchical")
# The gate's [tokens, experts] tensors alive at once at the peak of a step, measured: about 12 (float32).
_GATE_TENSORS_AT_PEAK = 12


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=positive_int_list, default=[8, 64, 1024, 4096], help="local experts per rank")
    p.add_argument("--tokens", type=positive_int_list, default=[2048, 32768], help="tokens per rank")
    p.add_argument("--k", type=positive_int_list, default=[1, 2, 4], help="experts per token (flat gate)")
    p.add_argument("--gates", type=_gate_list, default=list(GATES), help="flat,hierarchical")
    p.add_argument("--ranks", type=positive_int_list, default=[1, 2], help="expert-parallel processes")
    p.add_argument("--d-model", type=positive_int, default=16)
    p.add_argument("--hidden", type=positive_int, default=32)
    p.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    check_out_file(p, args.out)
    for k in args.k:
        if k > min(args.experts):
            p.error(f"--k {k} is larger than --experts {min(args.experts)}")
    return args


def _gate_list(text: str) -> list[str]:
    gates = [g.strip() for g in text.split(",")]
    bad = [g for g in gates if g not in GATES]
    if bad or not gates:
        raise argparse.ArgumentTypeError(f"expected gates from {','.join(GATES)}, got {text!r}")
    return gates


def hierarchical_shape(num_experts: int, ranks: int, k: int) -> tuple[int, int, int, int]:
    """(groups, experts per group, k primary, k secondary): about sqrt(E) groups, a multiple of the ranks."""
    groups = ranks
    while groups * 2 <= math.isqrt(num_experts) and num_experts % (groups * 2) == 0:
        groups *= 2
    per_group = num_experts // groups
    return groups, per_group, min(k, groups), min(2, per_group)


def build_layer(gate: str, local_experts: int, ranks: int, rank: int, k: int, d: int, h: int):
    from moe_scale.config import MoEConfig
    from moe_scale.moe.hierarchical_layer import HierarchicalMoELayer
    from moe_scale.moe.layer import MoELayer
    from moe_scale.moe.router.hierarchical import HierarchicalRouter

    num_experts = local_experts * ranks
    config = MoEConfig()
    config.experts.num_experts, config.experts.hidden, config.router.top_k = num_experts, h, k
    config.experts.grad_reuse = False
    router, layer_class = None, MoELayer
    if gate == "hierarchical":
        groups, per_group, kp, ks = hierarchical_shape(num_experts, ranks, k)
        router, layer_class = HierarchicalRouter(d, groups, per_group, kp, ks), HierarchicalMoELayer
    layer = layer_class(config, d, ep_size=ranks, ep_rank=rank, router=router)
    if ranks > 1:
        layer.set_deepspeed_parallelism()
    return layer.train()


def count_step(gate: str, local_experts: int, tokens: int, k: int, ranks: int, rank: int, d: int, h: int,
               policy=None) -> dict:
    """One forward and backward of a fresh layer, counted after one uncounted step (lazy setup), under the GPU's
    kernel decisions (or `policy`)."""
    from op_count import OpCounter
    from moe_scale.moe.kernel_policy import GPU, forced_policy

    torch.manual_seed(rank)
    layer = build_layer(gate, local_experts, ranks, rank, k, d, h)
    x = torch.randn(tokens, d, requires_grad=True)
    grad_y = torch.randn(tokens, d)
    with forced_policy(policy or GPU):
        y, aux = layer(x)                       # once uncounted: first calls may set things up
        torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])
        with OpCounter() as forward:
            y, aux = layer(x)
        with OpCounter() as backward:
            torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])
    names = forward.by_name + backward.by_name
    return {"ops": forward.ops + backward.ops, "ops_forward": forward.ops, "ops_backward": backward.ops,
            "kernel_ops": forward.kernel_ops + backward.kernel_ops,
            "host_syncs_forward": forward.host_syncs, "host_syncs_backward": backward.host_syncs,
            "syncs": dict(forward.syncs + backward.syncs), "grouped_gemm_calls": names["_grouped_mm"]}


def _rank_worker(rank: int, port: int, cases: list[tuple], d: int, h: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_SIZE="2", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=30))
    from moe_scale.distributed.launch import init_deepspeed_comm

    init_deepspeed_comm("gloo")
    for case in cases:
        results.put((rank, case, count_step(*case[:4], 2, rank, d, h)))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def memory_needed(gate: str, tokens: int, local_experts: int, ranks: int, k: int = 2) -> int:
    """Bytes of host memory a case needs on this machine, all ranks together: the gate's [N, E] tensors (the
    hierarchical gate's are [N, A] and [N*Kp, G])."""
    width = local_experts * ranks
    if gate == "hierarchical":
        groups, per_group, kp, _ = hierarchical_shape(width, ranks, k)
        width = groups + kp * per_group
    return ranks * _GATE_TENSORS_AT_PEAK * tokens * width * 4


def _available_memory() -> int:
    import psutil

    return psutil.virtual_memory().available


def _merge(per_rank: list[dict]) -> dict:
    """The larger count of the ranks for every number."""
    merged = dict(per_rank[0])
    for other in per_rank[1:]:
        for key, value in other.items():
            if isinstance(value, int):
                merged[key] = max(merged[key], value)
    return merged


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = [(gate, e, n, k) for gate in args.gates for e in args.experts for n in args.tokens for k in args.k]

    def report(case, ranks, counts):
        gate, experts, tokens, k = case
        emit({"experts": experts, "tokens": tokens, "k": k, "gate": gate, "ranks": ranks, "d_model": args.d_model,
              "hidden": args.hidden, **counts}, args.out)

    def runnable(ranks: int) -> list[tuple]:
        """The cases that fit this machine's memory; the others are reported as skipped, saying why."""
        fit = []
        for case in cases:
            gate, experts, tokens, k = case
            need, have = memory_needed(gate, tokens, experts, ranks, k), _available_memory()
            if need > 0.8 * have:
                report(case, ranks, {"skipped": f"needs about {need / 2**30:.0f} GiB of host memory for the gate's "
                                                f"[tokens x experts] tensors; {have / 2**30:.0f} GiB available"})
            else:
                fit.append(case)
        return fit

    if 1 in args.ranks:
        for case in runnable(1):
            report(case, 1, count_step(*case, 1, 0, args.d_model, args.hidden))
    if 2 in args.ranks:
        two_rank_cases = runnable(2)
        context = mp.get_context("spawn")
        results = context.Queue()
        procs = [context.Process(target=_rank_worker, args=(rank, port, two_rank_cases, args.d_model, args.hidden,
                                                             results))
                 for port in [free_port()] for rank in range(2)]
        for proc in procs:
            proc.start()
        got: dict[tuple, list[dict]] = {}
        pending = 2 * len(two_rank_cases)
        while pending:
            try:
                rank, case, counts = results.get(timeout=5)
            except queue.Empty:
                failed = [proc.exitcode for proc in procs if proc.exitcode]
                if failed:
                    for proc in procs:
                        proc.terminate()
                    print(f"count_ops: a rank failed (exit code {failed[0]})", file=sys.stderr)
                    return 1
                continue
            pending -= 1
            got.setdefault(case, []).append(counts)
            if len(got[case]) == 2:
                report(case, 2, _merge(got[case]))
        for proc in procs:
            proc.join()
    unsupported = sorted(set(args.ranks) - {1, 2})
    if unsupported:
        print(f"count_ops: --ranks {unsupported} skipped (1 and 2 are supported)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
