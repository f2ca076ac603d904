"""A per-rank receive budget for dropless dispatch (`--rank-capacity-factor F`, issue 54 part 3): each rank sends
each expert-parallel rank at most ceil(F x its pairs / ranks) pairs, its highest gates; with synthetic skew the
receive peak stays within the budget, the dropped pairs are exactly a brute force's, the output is the dense
reference over the kept pairs, and the dropped fraction is logged. The overload factors (max / mean per expert and
per rank) reach the log line and `eval --expert-stats`."""

from __future__ import annotations

import math

import pytest
import torch

from moe_scale.metrics.balance import balance_metrics, overload_text
from moe_scale.moe.dispatch import AllToAllDispatcher
from tests.moe.dispatch.test_dispatch import apply_experts, dense_reference, make_case, top_k_pairs
from tests.multiproc import run_ranks

F = 1.5


def _brute_force_kept(experts_NK: torch.Tensor, gates_NK: torch.Tensor, ranks: int, local: int) -> torch.Tensor:
    """Per destination rank, the pairs with the highest gates (ties: the lower pair index), up to the budget."""
    expert_C, gate_C = experts_NK.reshape(-1).tolist(), gates_NK.reshape(-1).tolist()
    budget = math.ceil(F * len(expert_C) / ranks)
    kept = torch.zeros(len(expert_C), dtype=torch.bool)
    for r in range(ranks):
        mine = sorted((c for c in range(len(expert_C)) if expert_C[c] // local == r), key=lambda c: (-gate_C[c], c))
        kept[mine[:budget]] = True
    return kept.view(experts_NK.shape)


@pytest.mark.parametrize("name", ["rank1_receives_nothing", "all_to_one_expert", "random"])
def test_one_rank_keeps_each_destinations_highest_gates_within_the_budget(name):
    x, experts, gates, w, _ = make_case(name, world=4)
    dispatcher = AllToAllDispatcher(8, 2, rank_capacity_factor=F)   # 4 ranks of 2 experts, as seen from one
    order, dropped, kept_E = dispatcher._keep_within_rank_budget(experts.reshape(-1), gates.reshape(-1))
    kept = _brute_force_kept(experts, gates, ranks=4, local=2).reshape(-1)
    assert sorted(order[~dropped].tolist()) == kept.nonzero()[:, 0].tolist()
    assert kept_E.tolist() == torch.bincount(experts.reshape(-1)[kept], minlength=8).tolist()
    assert torch.equal(experts.reshape(-1)[order[~dropped]], experts.reshape(-1)[order[~dropped]].sort().values)


def _budget_worker(rank, world, name):
    x_all, experts_all, gates_all, w_all, _ = make_case(name, world=world)
    n, e = x_all.shape[0] // world, w_all.shape[0]
    local, mine = e // world, slice(rank * (x_all.shape[0] // world), (rank + 1) * (x_all.shape[0] // world))
    dispatcher = AllToAllDispatcher(e, local, rank_capacity_factor=F)
    dispatcher.connect(torch.distributed.new_group(list(range(world))))
    gates = gates_all[mine].reshape(-1)
    rows, state = dispatcher.dispatch(x_all[mine], *top_k_pairs(experts_all[mine]), gates)
    out = dispatcher.combine(apply_experts(rows, w_all[rank * local:(rank + 1) * local], state.tokens_per_expert),
                             gates, state)
    return {"out": out, "received": sum(state.tokens_per_expert), "dropped": state.dropped_pairs,
            "fraction": float(dispatcher.dropped_fraction(state, None)),
            "budget": dispatcher.rank_budget(experts_all[mine].numel())}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["rank1_receives_nothing", "all_to_one_expert"])
def test_two_ranks_under_skew_receive_within_the_budget_and_drop_what_a_brute_force_drops(name):
    results = run_ranks(_budget_worker, world_size=2, args=(name,), timeout=90)
    x_all, experts_all, gates_all, w_all, _ = make_case(name, world=2)
    n = x_all.shape[0] // 2
    budget = results[0]["budget"]
    assert budget == math.ceil(F * experts_all[:n].numel() / 2)
    assert max(r["received"] for r in results) <= 2 * budget
    assert results[0]["received"] == 2 * budget   # every source sends rank 0 its whole budget: the skew's peak
    for rank, got in enumerate(results):
        mine = slice(rank * n, (rank + 1) * n)
        kept = _brute_force_kept(experts_all[mine], gates_all[mine], ranks=2, local=4)
        assert got["dropped"] == int((~kept).sum()) > 0
        assert got["fraction"] == pytest.approx(int((~kept).sum()) / kept.numel())
        torch.testing.assert_close(got["out"], dense_reference(x_all[mine], experts_all[mine],
                                                               gates_all[mine] * kept, w_all))


def test_the_overload_factors_per_expert_and_per_rank():
    load_E = torch.tensor([8.0, 0.0, 4.0, 4.0, 1.0, 1.0, 1.0, 1.0])   # ranks of 2: 8, 8, 2, 2 (mean 5)
    values = balance_metrics(load_E, load_E, ranks=4)
    assert values["max_over_mean_load"] == pytest.approx(8 / 2.5)
    assert values["max_over_mean_rank_load"] == pytest.approx(1.6)
    assert "max_over_mean_rank_load" not in balance_metrics(load_E, load_E)
    assert overload_text(values) == "  cv(load) 1.000 max/mean load 3.20 (1.60 per rank)"
    two = {f"layer{i}_{k}": v for i in (0, 1) for k, v in values.items()}
    assert overload_text(two).count("per rank") == 2 and overload_text(two).startswith("  L0 cv(load)")


def test_eval_expert_stats_print_the_overload_per_rank():
    from moe_scale.train.expert_tokens import format_expert_report

    load_E = torch.tensor([8.0, 0.0, 4.0, 4.0, 1.0, 1.0, 1.0, 1.0])
    stats = {**balance_metrics(load_E, load_E, ranks=4), "tokens": 20,
             "experts": [{"expert": e, "load": int(v), "importance": float(v)} for e, v in enumerate(load_E)]}
    assert "max/mean load 3.20 (1.60 per rank)" in format_expert_report({"layer0": stats}, 0).splitlines()[0]
