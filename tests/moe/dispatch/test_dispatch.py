"""AllToAllDispatcher: regrouping index, local dispatch/combine, capacity accounting, and R-rank gloo
(flat and hierarchical exchange, dropless and capacity) == 1 process."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from op_count import OpCounter
from moe_scale.moe.dispatch import AllToAllDispatcher, StaticCapacityDispatcher
from moe_scale.moe.dispatch.exchange import block_transpose_index
from tests.multiproc import run_ranks

D = 8


# ---------------------------------------------------------------- regrouping index


def brute_force_regroup(counts_PL: torch.Tensor) -> torch.Tensor:
    """Label every arrived row with (source p, local expert l, j); return arrival positions in (l, p, j) order."""
    labels = []
    for p in range(counts_PL.shape[0]):
        for l in range(counts_PL.shape[1]):
            labels += [(l, p, j) for j in range(int(counts_PL[p, l]))]
    order = sorted(range(len(labels)), key=lambda i: labels[i])
    return torch.tensor(order, dtype=torch.long)


@pytest.mark.parametrize("p,l", [(1, 1), (1, 5), (2, 4), (3, 2), (4, 3)])
def testblock_transpose_index_matches_brute_force(p, l):
    gen = torch.Generator().manual_seed(p * 10 + l)
    for trial in range(20):
        counts = torch.randint(0, 4, (p, l), generator=gen)
        if trial % 5 == 0:
            counts[torch.rand(p, l, generator=gen) < 0.5] = 0     # many empty blocks
        got = block_transpose_index(counts, int(counts.sum()))
        assert got.dtype == torch.long
        assert torch.equal(got, brute_force_regroup(counts)), counts


def testblock_transpose_index_all_zero_and_one_block():
    assert block_transpose_index(torch.zeros(2, 3, dtype=torch.long), 0).numel() == 0
    counts = torch.zeros(3, 2, dtype=torch.long)
    counts[1, 1] = 4
    assert torch.equal(block_transpose_index(counts, 4), torch.arange(4))


# ---------------------------------------------------------------- data


def distinct_experts(n: int, k: int, choices: list[int], gen: torch.Generator) -> torch.Tensor:
    """[n, k] expert ids, distinct within each row (as top-k gives), drawn from `choices`."""
    choices_t = torch.tensor(choices)
    return torch.stack([choices_t[torch.randperm(len(choices), generator=gen)[:k]] for _ in range(n)])


def make_case(name: str, n_per_rank: int = 12, k: int = 2, e: int = 8, world: int = 2):
    """Global batch for a `world`-rank run: rank r owns tokens [r*n, (r+1)*n). Same data in every process."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    n = n_per_rank * world
    x = torch.randn(n, D, generator=gen, dtype=torch.float64)
    gates = torch.rand(n, k, generator=gen, dtype=torch.float64)
    w = torch.randn(e, D, D, generator=gen, dtype=torch.float64)      # per-expert function: rows @ w[e]
    upstream = torch.randn(n, D, generator=gen, dtype=torch.float64)  # loss = sum(out * upstream)
    half = e // world
    if name == "random":
        experts = distinct_experts(n, k, list(range(e)), gen)
    elif name == "rank1_receives_nothing":              # every copy goes to rank 0's experts 0..3
        experts = distinct_experts(n, k, list(range(half)), gen)
    elif name == "some_experts_empty":                  # experts 1, 3, 4, 7 get nothing
        experts = distinct_experts(n, k, [0, 2, 5, 6], gen)
    elif name == "all_to_one_expert":                   # k = 1, every token picks expert 3
        experts = torch.full((n, 1), 3)
        gates = gates[:, :1].contiguous()
    elif name == "no_cross_traffic":                    # each rank only routes to its own experts
        experts = torch.cat([distinct_experts(n_per_rank, k, list(range(r * half, (r + 1) * half)), gen)
                             for r in range(world)])
    else:
        raise ValueError(name)
    return x, experts, gates, w, upstream


def apply_experts(rows_MD, w_LDD, tokens_per_expert):
    """Per-expert function on contiguous expert blocks (plain autograd)."""
    out, start = [], 0
    for local, count in enumerate(tokens_per_expert):
        out.append(rows_MD[start:start + count] @ w_LDD[local])
        start += count
    assert start == rows_MD.shape[0], "tokens_per_expert must cover every arrived row"
    return torch.cat(out)


def dense_reference(x, experts, gates, w):
    """out[n] = sum_k gates[n, k] * (x[n] @ w[experts[n, k]]), one token and one k at a time."""
    rows = []
    for n in range(x.shape[0]):
        acc = x.new_zeros(x.shape[1])
        for j in range(experts.shape[1]):
            acc = acc + gates[n, j] * (x[n] @ w[experts[n, j]])
        rows.append(acc)
    return torch.stack(rows)


def top_k_pairs(experts_NK):
    """(token_index_P, expert_P) of a top-k routing, as RouterOutput.pairs() gives them."""
    n, k = experts_NK.shape
    return torch.arange(n).repeat_interleave(k), experts_NK.reshape(-1)


def local_moe(x, experts, gates, w):
    """ep_size 1: dispatch -> per-expert function -> combine."""
    dispatcher = AllToAllDispatcher(w.shape[0], w.shape[0])
    rows, state = dispatcher.dispatch(x, *top_k_pairs(experts))
    return dispatcher.combine(apply_experts(rows, w, state.tokens_per_expert), gates.reshape(-1), state), rows, state


# ---------------------------------------------------------------- one process


def test_identity_experts_give_gate_weighted_sum():
    gen = torch.Generator().manual_seed(0)
    n, k, e = 20, 3, 6
    x = torch.randn(n, D, generator=gen, dtype=torch.float64)
    experts = distinct_experts(n, k, list(range(e)), gen)
    gates = torch.rand(n, k, generator=gen, dtype=torch.float64)
    dispatcher = AllToAllDispatcher(e, e)
    rows, state = dispatcher.dispatch(x, *top_k_pairs(experts))
    assert rows.shape == (n * k, D)
    assert state.tokens_per_expert == torch.bincount(experts.reshape(-1), minlength=e).tolist()
    # Rows are grouped by expert: block e holds exactly the tokens routed to e (in token order).
    start = 0
    for expert, count in enumerate(state.tokens_per_expert):
        tokens = (experts == expert).any(1).nonzero().squeeze(1)
        torch.testing.assert_close(rows[start:start + count], x[tokens], rtol=0, atol=0)
        start += count
    out = dispatcher.combine(rows, gates.reshape(-1), state)
    torch.testing.assert_close(out, gates.sum(1, keepdim=True) * x)


def test_per_expert_scale_matches_dense_loop():
    gen = torch.Generator().manual_seed(1)
    n, k, e = 16, 2, 5
    x = torch.randn(n, D, generator=gen, dtype=torch.float64)
    experts = distinct_experts(n, k, [0, 1, 3, 4], gen)          # expert 2 gets no tokens
    gates = torch.rand(n, k, generator=gen, dtype=torch.float64)
    dispatcher = AllToAllDispatcher(e, e)
    rows, state = dispatcher.dispatch(x, *top_k_pairs(experts))
    assert state.tokens_per_expert[2] == 0
    scale = torch.repeat_interleave(torch.arange(1.0, e + 1, dtype=torch.float64),
                                    torch.tensor(state.tokens_per_expert))
    out = dispatcher.combine(rows * scale[:, None], gates.reshape(-1), state)
    want = torch.stack([sum(gates[t, j] * (experts[t, j] + 1) * x[t] for j in range(k)) for t in range(n)])
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("name", ["random", "some_experts_empty"])
def test_local_dispatch_combine_and_grads_match_dense_loop(name):
    x, experts, gates, w, upstream = make_case(name)
    x.requires_grad_(True), gates.requires_grad_(True), w.requires_grad_(True)
    out, _, _ = local_moe(x, experts, gates, w)
    ref = dense_reference(x, experts, gates, w)
    torch.testing.assert_close(out, ref)
    got = torch.autograd.grad((out * upstream).sum(), (x, gates, w))
    want = torch.autograd.grad((ref * upstream).sum(), (x, gates, w))
    for g, r, what in zip(got, want, ("x", "gates", "w")):
        torch.testing.assert_close(g, r, msg=lambda m, what=what: f"grad of {what}: {m}")


def test_float32_gates_with_float64_rows_and_empty_batch():
    dispatcher = AllToAllDispatcher(4, 4)
    x = torch.randn(3, D, dtype=torch.float64)
    experts = torch.tensor([[0, 1], [1, 2], [3, 0]])
    gates = torch.rand(3, 2)                                     # routers emit float32 gates
    rows, state = dispatcher.dispatch(x, *top_k_pairs(experts))
    out = dispatcher.combine(rows, gates.reshape(-1), state)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, gates.double().sum(1, keepdim=True) * x)
    # No tokens at all (e.g. an empty micro-batch): shapes stay consistent.
    rows, state = dispatcher.dispatch(x[:0], *top_k_pairs(experts[:0]))
    assert rows.shape == (0, D) and state.tokens_per_expert == [0, 0, 0, 0]
    assert dispatcher.combine(rows, gates[:0].reshape(-1), state).shape == (0, D)


# ---------------------------------------------------------------- capacity accounting, by hand


def test_capacity_keeps_the_highest_gates_per_expert():
    # Six (token, expert) pairs, two experts. Capacity = ceil(factor * 6 / 2).
    experts = torch.tensor([0, 0, 0, 1, 0, 1])
    gates = torch.tensor([0.9, 0.2, 0.5, 0.4, 0.7, 0.1])
    x = torch.arange(6.0)[:, None].repeat(1, D)          # token t's row is all t
    tokens = torch.arange(6)

    full = AllToAllDispatcher(2, 2, mode="capacity", capacity_factor=1.0)      # capacity 3
    rows, state = full.dispatch(x, tokens, experts, gates)
    assert full.capacity(6) == 3
    assert state.tokens_per_expert == [3, 2] and (state.dropped_pairs, state.num_pairs) == (1, 6)
    assert rows[:, 0].tolist() == [0, 4, 2, 3, 5]         # expert 0: gates .9 .7 .5 (pair 1, gate .2, dropped)

    half = AllToAllDispatcher(2, 2, mode="capacity", capacity_factor=0.5)      # capacity ceil(1.5) = 2
    rows, state = half.dispatch(x, tokens, experts, gates)
    assert state.tokens_per_expert == [2, 2] and state.dropped_pairs == 2
    assert rows[:, 0].tolist() == [0, 4, 3, 5]
    out = half.combine(rows, gates, state)                # identity experts: out[t] = kept gate * x[t]
    kept_gate = torch.tensor([0.9, 0.0, 0.0, 0.4, 0.7, 0.1])
    torch.testing.assert_close(out, kept_gate[:, None] * x)


def test_capacity_ties_keep_the_lower_pair_index_and_dropless_drops_nothing():
    experts = torch.zeros(5, dtype=torch.long)
    gates = torch.full((5,), 0.5)
    x = torch.arange(5.0)[:, None].repeat(1, D)
    d = AllToAllDispatcher(4, 4, mode="capacity", capacity_factor=4.0)       # ceil(4 * 5 / 4) = 5: all fit
    assert d.dispatch(x, torch.arange(5), experts, gates)[1].dropped_pairs == 0
    d = AllToAllDispatcher(4, 4, mode="capacity", capacity_factor=1.0)       # ceil(5 / 4) = 2
    rows, state = d.dispatch(x, torch.arange(5), experts, gates)
    assert rows[:, 0].tolist() == [0, 1] and state.dropped_pairs == 3 and state.tokens_per_expert == [2, 0, 0, 0]
    rows, state = AllToAllDispatcher(4, 4).dispatch(x, torch.arange(5), experts, gates)
    assert state.dropped_pairs == 0 and state.tokens_per_expert == [5, 0, 0, 0]


def test_one_rank_row_level_dispatch_moves_nothing_unless_a_token_is_dropped():
    """dispatch_rows / follow_pairs / combine_rows, the layer's path: with one rank and every token routed the
    rows are the tokens themselves (no copy) and the per-row sums are the output; when capacity drops every
    copy of a token, the rows are the surviving tokens and the dropped token's output is zero."""
    experts = torch.tensor([0, 1, 1, 0, 1, 0])                # tokens 0..2, two experts each
    tokens = torch.tensor([0, 0, 1, 1, 2, 2])
    gates = torch.tensor([0.6, 0.1, 0.2, 0.9, 0.3, 0.7])
    x = torch.randn(3, D)
    dispatcher = AllToAllDispatcher(2, 2)
    rows, state = dispatcher.dispatch_rows(x, tokens, experts, gates)
    assert rows is x and state.rows_are_tokens
    assert state.arrived_row_M.tolist() == [0, 1, 2, 0, 1, 2]  # expert 0's pairs, then expert 1's
    assert dispatcher.follow_pairs(gates, state).tolist() == pytest.approx([0.6, 0.9, 0.7, 0.1, 0.2, 0.3])
    per_row = torch.randn(3, D)
    assert dispatcher.combine_rows(per_row, state) is per_row

    capacity = AllToAllDispatcher(2, 2, mode="capacity", capacity_factor=1 / 3)   # one copy per expert:
    # expert 0 keeps token 1 (gate .9), expert 1 keeps token 2 (gate .3)
    rows, state = capacity.dispatch_rows(x, tokens, experts, gates)
    assert not state.rows_are_tokens and state.unique_token_U.tolist() == [1, 2]  # token 0 lost both copies
    torch.testing.assert_close(rows, x[1:])
    out = capacity.combine_rows(torch.ones(2, D), state)
    assert out[0].abs().sum() == 0 and torch.equal(out[1:], torch.ones(2, D))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_one_rank_with_every_token_routed_reads_nothing_and_gives_the_general_paths_state(k):
    """every_token (top-k gates) on one rank, dropless: the rows are the tokens, the pairs sorted by expert, in a
    few operations and without a read of the device (no count exchange needs one: nothing travels); the arrived
    rows, their experts, the gates they follow and the counts are the general path's, which reads the counts."""
    gen = torch.Generator().manual_seed(k)
    n, e = 40, 8
    experts = distinct_experts(n, k, list(range(e)), gen)
    experts[:5] = experts[5]   # several tokens on the same experts: ties kept in pair order
    tokens = torch.arange(n).repeat_interleave(k)
    gates = torch.rand(n * k, generator=gen)
    x = torch.randn(n, D, generator=gen)
    dispatcher = AllToAllDispatcher(e, e)
    general_rows, general = dispatcher.dispatch_rows(x, tokens, experts.reshape(-1), gates)
    with OpCounter() as counter:
        rows, state = dispatcher.dispatch_rows(x, tokens, experts.reshape(-1), gates, every_token=True)
        followed = dispatcher.follow_pairs(gates, state)
        counts_L, host = state.expert_counts().device_L, state.expert_counts().host
    assert counter.host_syncs == 0 and counter.kernel_ops <= 8, (counter.syncs, counter.by_name)
    assert general.tokens_per_expert is not None and host is None   # the general path read them; this one did not
    assert rows is x and general_rows is x and state.rows_are_tokens and general.rows_are_tokens
    assert torch.equal(state.arrived_row_M, general.arrived_row_M) and torch.equal(state.pair_local_experts(),
                                                                                   general.pair_local_experts())
    assert torch.equal(counts_L, general.expert_counts().device_L) and counts_L.tolist() == general.tokens_per_expert
    assert torch.equal(followed, dispatcher.follow_pairs(gates, general))
    assert torch.equal(state.local_row_tokens(), general.local_row_tokens()) and state.num_arrived_rows == n
    assert (state.dropped_pairs, state.num_pairs) == (general.dropped_pairs, general.num_pairs) == (0, n * k)
    per_row = torch.randn(n, D)
    assert dispatcher.combine_rows(per_row, state) is per_row
    # capacity mode may drop copies: the general path (and its read) stays
    capacity = AllToAllDispatcher(e, e, mode="capacity", capacity_factor=1.0)
    with OpCounter() as counter:
        capacity.dispatch_rows(x, tokens, experts.reshape(-1), gates, every_token=True)
    assert counter.syncs["Tensor.tolist"] == 1


def test_bad_dispatch_settings_are_refused():
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        AllToAllDispatcher(4, 4, mode="capacity", capacity_factor=0.0)
    with pytest.raises(ValueError, match="dispatch mode"):
        AllToAllDispatcher(4, 4, mode="drop-some")
    with pytest.raises(ValueError, match="needs the gates"):
        AllToAllDispatcher(4, 4, mode="capacity").dispatch(torch.zeros(2, D), torch.arange(2),
                                                           torch.zeros(2, dtype=torch.long))


# ---------------------------------------------------------------- R processes (gloo)


def _rank_worker(rank, world, name, mode, exchange, node_size):
    """Rank `rank` of an ep_size = world run on its slice of the global case."""
    x_all, experts_all, gates_all, w_all, upstream_all = make_case(name, world=world)
    n, e = x_all.shape[0] // world, w_all.shape[0]
    local = e // world
    mine = slice(rank * n, (rank + 1) * n)
    x = x_all[mine].clone().requires_grad_(True)
    gates = gates_all[mine].clone().requires_grad_(True)
    w = w_all[rank * local:(rank + 1) * local].clone().requires_grad_(True)
    dispatcher = AllToAllDispatcher(e, local, mode=mode, capacity_factor=0.75)
    ep_group = torch.distributed.new_group(list(range(world)))
    dispatcher.connect(ep_group, exchange, node_size)
    rows, state = dispatcher.dispatch(x, *top_k_pairs(experts_all[mine]), gates.reshape(-1))
    out = dispatcher.combine(apply_experts(rows, w, state.tokens_per_expert), gates.reshape(-1), state)
    (out * upstream_all[mine]).sum().backward()
    calls = dispatcher.timer.calls
    with torch.no_grad():   # the row-level half: which rows arrive, in which order, and which row each pair reads
        rows_RD, rows_state = dispatcher.dispatch_rows(x, *top_k_pairs(experts_all[mine]), gates.reshape(-1))
    got = {"out": out.detach(), "x_grad": x.grad, "gates_grad": gates.grad, "w_grad": w.grad,
           "tokens_per_expert": state.tokens_per_expert, "arrived": rows.shape[0],
           "dropped": state.dropped_pairs, "calls": calls, "arrived_rows": state.num_arrived_rows,
           "rows_RD": rows_RD, "arrived_row_M": rows_state.arrived_row_M}
    if mode == "capacity":   # the same case in fixed-size slots: what the MoE layer runs (no count read)
        static = StaticCapacityDispatcher(e, local, capacity_factor=0.75)
        static.connect(ep_group, exchange, node_size)
        x.grad = gates.grad = w.grad = None
        with OpCounter() as counted:
            rows, state = static.dispatch(x, *top_k_pairs(experts_all[mine]), gates.reshape(-1))
            out = static.combine(apply_experts(rows, w, state.expert_counts().host), gates.reshape(-1), state)
        (out * upstream_all[mine]).sum().backward()
        got["static"] = {"out": out.detach(), "x_grad": x.grad, "gates_grad": gates.grad, "w_grad": w.grad,
                         "dropped": int(state.dropped_pairs), "reads": counted.host_syncs}
    return got


def expected_rows_and_pairs(experts_all, world, rank):
    """Dropless, by brute force: the arrived rows as (source rank, token) in arrival order (source rank, then
    token), and for each arrived pair, grouped by local expert, then source rank, then pair index, its row."""
    n, local = experts_all.shape[0] // world, 8 // world   # make_case: 8 experts
    rows = [(s, t) for s in range(world) for t in range(n)
            if any(int(e) // local == rank for e in experts_all[s * n + t])]
    pairs = sorted((int(e) % local, s, t * experts_all.shape[1] + j, rows.index((s, t)))
                   for s in range(world) for t in range(n) for j, e in enumerate(experts_all[s * n + t])
                   if int(e) // local == rank)
    return rows, [pair[-1] for pair in pairs]


def per_rank_reference(name, mode, world):
    """One process, all experts local, each rank's tokens dispatched on their own (capacity is per rank)."""
    x_all, experts_all, gates_all, w_all, upstream_all = make_case(name, world=world)
    n = x_all.shape[0] // world
    w = w_all.clone().requires_grad_(True)
    results, w_grad = [], torch.zeros_like(w_all)
    for rank in range(world):
        mine = slice(rank * n, (rank + 1) * n)
        x = x_all[mine].clone().requires_grad_(True)
        gates = gates_all[mine].clone().requires_grad_(True)
        dispatcher = AllToAllDispatcher(w.shape[0], w.shape[0], mode=mode, capacity_factor=0.75)
        rows, state = dispatcher.dispatch(x, *top_k_pairs(experts_all[mine]), gates.reshape(-1))
        out = dispatcher.combine(apply_experts(rows, w, state.tokens_per_expert), gates.reshape(-1), state)
        gx, gg, gw = torch.autograd.grad((out * upstream_all[mine]).sum(), (x, gates, w))
        w_grad += gw
        results.append({"out": out.detach(), "x_grad": gx, "gates_grad": gg, "dropped": state.dropped_pairs,
                        "counts": torch.tensor(state.tokens_per_expert)})
        if mode == "dropless":
            torch.testing.assert_close(out, dense_reference(x_all[mine], experts_all[mine], gates_all[mine], w_all))
    return results, w_grad


CASES = ["random", "rank1_receives_nothing", "some_experts_empty", "no_cross_traffic", "all_to_one_expert"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,exchange,node_size", [(2, "flat", 0), (2, "hierarchical", 1),
                                                      (4, "flat", 0), (4, "hierarchical", 2)])
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_ranks_equal_single_process(world, exchange, node_size, mode):
    for name in CASES:
        results = run_ranks(_rank_worker, world_size=world, args=(name, mode, exchange, node_size), timeout=90)
        reference, ref_w_grad = per_rank_reference(name, mode, world)
        local = 8 // world
        arrived_per_expert = sum(r["counts"] for r in reference)
        for rank, (got, want) in enumerate(zip(results, reference)):
            experts_mine = slice(rank * local, (rank + 1) * local)
            assert got["tokens_per_expert"] == arrived_per_expert[experts_mine].tolist(), name
            assert got["dropped"] == want["dropped"], name
            for key in ("out", "x_grad", "gates_grad"):
                torch.testing.assert_close(got[key], want[key], msg=lambda m, key=key: f"{name} {key}: {m}")
            torch.testing.assert_close(got["w_grad"], ref_w_grad[experts_mine], msg=lambda m: f"{name} w: {m}")
            if mode == "capacity":   # fixed-size slots: the same outputs and gradients, and nothing read
                static = got["static"]
                assert static["dropped"] == want["dropped"] and static["reads"] == 0, (name, static["reads"])
                for key in ("out", "x_grad", "gates_grad"):
                    torch.testing.assert_close(static[key], want[key], msg=lambda m, key=key: f"{name} {key}: {m}")
                torch.testing.assert_close(static["w_grad"], ref_w_grad[experts_mine], msg=lambda m: f"{name}: {m}")
        if mode == "dropless":   # rows arrive in the order the dispatcher documents; pairs read the right ones
            x_all, experts_all = make_case(name, world=world)[:2]
            for rank, got in enumerate(results):
                rows, pair_rows = expected_rows_and_pairs(experts_all, world, rank)
                n = x_all.shape[0] // world
                want_rows = x_all[[s * n + t for s, t in rows]] if rows else x_all[:0]
                assert torch.equal(got["rows_RD"], want_rows), name
                assert got["arrived_row_M"].tolist() == pair_rows, name
        if name == "rank1_receives_nothing":
            assert all(r["arrived"] == 0 and torch.count_nonzero(r["w_grad"]) == 0 for r in results[1:])
        # Per hop: 1 counts exchange (rows and pairs together); rows, pair metadata, gates, rows back; 3 of them
        # backward. One rank per node (or one node) leaves one hop: the flat exchange.
        hops = 2 if exchange == "hierarchical" and 1 not in (node_size, world // node_size) else 1
        assert results[0]["calls"] == hops * 8
        # A token crosses to a rank once however many of its experts live there.
        experts_all = make_case(name, world=world)[1]
        for rank, got in enumerate(results):
            senders = {(t, int(e) // local) for t, row in enumerate(experts_all.tolist()) for e in row}
            want_rows = sum(1 for t, dest in senders if dest == rank)
            assert got["arrived_rows"] == want_rows or mode == "capacity", name
        if mode == "capacity" and name == "all_to_one_expert":
            assert all(r["dropped"] > 0 for r in results)


# ---------------------------------------------------------------- launches of the expert-parallel dispatch

# Kernel-launching operations of one warm 2-rank flat dispatch as the MoE layer uses it (dispatch_rows, the gates
# following the pairs, combine_rows; the counts exchange and its one read included), with what the worker adds
# around it (a gather and a gate product: 2 forward, 5 backward), measured. Before the planning was whole-tensor:
# 85 and 27 (77 and 24 without the allocations, which launch no kernel).
DISPATCH_KERNEL_OPS_FORWARD, DISPATCH_KERNEL_OPS_BACKWARD = 42, 21


def _count_dispatch_worker(rank, world, local_experts):
    """Kernel ops and host reads of a warm 2-rank dispatch at `local_experts` experts per rank."""
    gen = torch.Generator().manual_seed(rank)
    n, k, e = 64, 2, local_experts * world
    x = torch.randn(n, D, generator=gen, requires_grad=True)
    gate_C = torch.rand(n * k, generator=gen, requires_grad=True)
    token_C, expert_C = top_k_pairs(distinct_experts(n, k, list(range(e)), gen))
    dispatcher = AllToAllDispatcher(e, local_experts)
    dispatcher.connect(torch.distributed.new_group(list(range(world))))

    def step():
        rows_RD, state = dispatcher.dispatch_rows(x, token_C, expert_C, gate_C, every_token=True)
        gates_M = dispatcher.follow_pairs(gate_C, state)
        per_row_RD = rows_RD.new_zeros(state.num_arrived_rows, D).index_add(0, state.arrived_row_M,
                                                                            rows_RD.index_select(0, state.arrived_row_M)
                                                                            * gates_M[:, None])
        return dispatcher.combine_rows(per_row_RD, state)

    step().sum().backward()
    with OpCounter() as forward:
        out = step()
    with OpCounter() as backward:
        out.sum().backward()
    return {"forward": forward.kernel_ops, "backward": backward.kernel_ops, "reads_forward": forward.host_syncs,
            "reads_backward": backward.host_syncs}


@pytest.mark.multiprocess
def test_two_rank_dispatch_launches_few_kernels_whatever_the_experts():
    """The dispatch's index planning is whole-tensor: its launches do not grow with the experts and stay at the
    measured count (the layer's own ops, experts and gate, come on top: tools/count_ops.py)."""
    counts = {}
    for local_experts in (1, 4, 64):
        results = run_ranks(_count_dispatch_worker, world_size=2, args=(local_experts,), timeout=90)
        for got in results:
            assert got["reads_forward"] == 1 and got["reads_backward"] == 0, (local_experts, got)
            assert got["forward"] <= DISPATCH_KERNEL_OPS_FORWARD, (local_experts, got)
            assert got["backward"] <= DISPATCH_KERNEL_OPS_BACKWARD, (local_experts, got)
        counts[local_experts] = results[0]
    assert counts[4] == counts[64]
    # one local expert: the pairs arrive grouped by expert already, nothing regroups them
    assert counts[1]["forward"] < counts[4]["forward"]
