#!/usr/bin/env python
"""Rows that cross nodes in the hierarchical all-to-all, with the node-limited gate against unlimited top-k.

    python tools/node_limited_rows.py --ranks 4 --node-size 2 --experts 16 --k 4 --tokens 1024

Starts --ranks gloo processes laid out as nodes of --node-size ranks (expert parallelism over all of them,
`--all-to-all hierarchical`), builds one MoE layer per setting below from moe_scale's config, routes the same
tokens (N(0, 1) inputs, gating matrices drawn so the logits have std --gate-logit-std, as a trained router's
spread) and counts what the exchange's second hop sends to other nodes: the rows that cross the network (one per
(token, destination rank) on another node). One JSON line per setting:

    unlimited            --gate aux_free (plain top-k of the same scores)
    groups=ranks M=m     --gate node_limited, one group per rank (A = ranks), each token's experts on <= m ranks
    groups=nodes M=m     --gate node_limited, one group per node (A = nodes), each token's experts on <= m nodes

with rows_crossing_nodes (summed over the ranks), per_token (rows / tokens) and the share of the unlimited gate's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from json_lines import emit, sig
from spawned_ranks import spawned_ranks
from tool_args import OneLineParser, check_out_file, non_negative_float, positive_int

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="node_limited_rows.py", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=positive_int, default=4, help="gloo processes (default 4)")
    p.add_argument("--node-size", type=positive_int, default=2, help="ranks per node (default 2)")
    p.add_argument("--experts", type=positive_int, default=16, help="experts over all ranks (default 16)")
    p.add_argument("--k", type=positive_int, default=4, help="experts per token (default 4)")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens per rank (default 1024)")
    p.add_argument("--d", type=positive_int, default=64, help="model width (default 64)")
    p.add_argument("--gate-logit-std", type=non_negative_float, default=2.0, help="logits' spread (default 2)")
    p.add_argument("--seed", type=positive_int, default=1)
    p.add_argument("--out", type=Path, help="also write the JSON lines here")
    args = p.parse_args(argv)
    if args.ranks % args.node_size or args.ranks == args.node_size:
        p.error(f"--ranks {args.ranks} must be a multiple of --node-size {args.node_size} over 2 nodes or more")
    if args.experts % args.ranks or args.k > args.experts // args.ranks:
        p.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks} with at least --k "
                f"{args.k} per rank (so M = 1 can hold a token's k experts)")
    check_out_file(p, args.out)
    return args


def settings(args) -> list[tuple[str, dict]]:
    """(name, config settings) of each measured gate."""
    nodes = args.ranks // args.node_size
    out = [("unlimited", {"gate": "aux_free"})]
    out += [(f"groups=ranks M={m}", {"gate": "node_limited", "expert_groups": args.ranks, "group_top_k": m})
            for m in sorted({1, 2, args.ranks // 2}) if m < args.ranks]
    out += [(f"groups=nodes M={m}", {"gate": "node_limited", "expert_groups": nodes, "group_top_k": m})
            for m in range(1, nodes)]
    return out


def rank_rows(rank: int, world: int, args, settings_: dict) -> tuple[int, int]:
    """(rows this rank's exchange sent to other nodes, tokens routed) for one gate's settings; the process group
    (gloo, DeepSpeed's) must be up."""
    import torch

    from moe_scale.config import RunConfig
    from moe_scale.moe.build import build_moe_layer
    from moe_scale.moe.dispatch import exchange

    config = RunConfig.from_settings(num_experts=args.experts, top_k=args.k, d_model=args.d, expert_hidden=16,
                                     ep_size=world, all_to_all="hierarchical", node_size=args.node_size,
                                     **settings_)
    config.resolve_implied_defaults(set(settings_))
    config.validate()
    torch.manual_seed(args.seed)   # the same router on every rank
    layer = build_moe_layer(config.moe, args.d, ep_size=world, ep_rank=rank, seed=args.seed)
    with torch.no_grad():
        layer.router.w_gate.normal_(0.0, args.gate_logit_std / args.d ** 0.5)
    layer.set_deepspeed_parallelism()
    crossing = []
    plan = exchange.HierarchicalExchange.plan

    def counted(self, counts):
        routes = plan(self, counts)   # (pairs, rows): the dispatcher plans both in one exchange of counts
        hop2 = routes[-1].stages[1].send_splits   # [node]: rows this rank sends to each node in the second hop
        crossing.append(sum(hop2) - hop2[rank // self.W])
        return routes

    x = torch.randn(args.tokens, args.d, generator=torch.Generator().manual_seed(args.seed * 1000 + rank))
    exchange.HierarchicalExchange.plan = counted
    try:
        with torch.no_grad():
            layer.eval()(x)
    finally:
        exchange.HierarchicalExchange.plan = plan
    return crossing[0], args.tokens


def _rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import torch
    import torch.distributed as dist

    from moe_scale.distributed.launch import init_deepspeed_comm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank % args.node_size))
    torch.set_num_threads(1)
    init_deepspeed_comm("gloo", verbose=False)
    for name, settings_ in settings(args):
        rows, tokens = rank_rows(rank, world, args, settings_)
        total = torch.tensor([rows, tokens])
        dist.all_reduce(total)
        if rank == 0:
            queue.put((name, int(total[0]), int(total[1])))
    if rank == 0:
        queue.put(None)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    unlimited = None
    for name, rows, tokens in spawned_ranks(_rank_main, args.ranks, args, "node_limited_rows.py"):
        unlimited = rows if unlimited is None else unlimited
        emit({"setting": name, "ranks": args.ranks, "node_size": args.node_size, "experts": args.experts,
              "k": args.k, "tokens": tokens, "rows_crossing_nodes": rows, "per_token": sig(rows / tokens),
              "of_unlimited": sig(rows / unlimited) if unlimited else None}, args.out)


if __name__ == "__main__":
    main()
