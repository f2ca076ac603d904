"""The node-limited gate (`--gate node_limited`, DeepSeek-V3's group-limited top-k): with every group open it is
the aux_free gate's top-k exactly; otherwise each token's experts are the best k of its M best groups (a per-token
brute force), its gates the chosen scores normalised and scaled, its losses the sequence-wise one plus an
optional CV² importance loss; its flags are checked in one line. 1 == 2 == 4 processes: tests/moe/test_layer.py."""

from __future__ import annotations

import pytest
import torch

from moe_scale.cli import main as cli_main
from moe_scale.config import RunConfig
from moe_scale.moe.losses import cv_squared
from moe_scale.moe.router import AuxFreeRouter, NodeLimitedRouter
from moe_scale.moe.router.node_limited import group_limited_top_k
from tests.cli_runs import FAST

D, E = 8, 16


def _pair(score: str, groups: int, open_groups: int, k: int = 3):
    torch.manual_seed(0)
    limited = NodeLimitedRouter(D, E, k, groups=groups, group_top_k=open_groups, score=score,
                                seq_balance_weight=0.01).double()
    plain = AuxFreeRouter(D, E, k, score=score, seq_balance_weight=0.01).double()
    with torch.no_grad():
        limited.w_gate.normal_(0.0, 1.0)
        limited.score_bias.copy_(torch.linspace(-0.3, 0.3, E))
    plain.load_state_dict(limited.state_dict())
    return limited, plain


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_every_group_open_is_the_aux_free_top_k(score):
    limited, plain = _pair(score, groups=4, open_groups=4)
    if score == "softmax":
        limited.normalize = False   # aux_free keeps softmax scores as they are
    x = torch.randn(24, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    a, b = limited(x, seq_len=8), plain(x, seq_len=8)
    for name in ("token_C", "expert_C", "gate_C", "aux_loss", "importance_E", "load_E"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0, msg=name)
    a.gate_C.sum().backward()
    b.gate_C.sum().backward()
    torch.testing.assert_close(limited.w_gate.grad, plain.w_gate.grad, rtol=0, atol=0)


def _brute_force(scores: list[float], k: int, groups: int, open_groups: int) -> list[int]:
    size = len(scores) // groups
    group_score = [sum(sorted(scores[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(groups)]
    best = sorted(range(groups), key=lambda g: -group_score[g])[:open_groups]
    allowed = [i for g in best for i in range(g * size, (g + 1) * size)]
    return sorted(allowed, key=lambda i: -scores[i])[:k]


@pytest.mark.parametrize("groups,open_groups,k", [(4, 1, 3), (4, 2, 3), (8, 3, 4), (16, 5, 2), (2, 1, 8)])
def test_each_token_takes_the_best_k_of_its_best_groups(groups, open_groups, k):
    biased = torch.rand(200, E, dtype=torch.float64, generator=torch.Generator().manual_seed(groups * 10 + k))
    chosen = group_limited_top_k(biased, k, groups, open_groups)
    size = E // groups
    for n in range(biased.shape[0]):
        assert chosen[n].tolist() == _brute_force(biased[n].tolist(), k, groups, open_groups)
        assert len({e // size for e in chosen[n].tolist()}) <= open_groups


def test_gates_are_normalised_and_scaled_and_the_cv_loss_is_added():
    torch.manual_seed(0)
    router = NodeLimitedRouter(D, E, 4, groups=4, group_top_k=2, routed_scaling_factor=2.5,
                               w_importance=0.3).double()
    x = torch.randn(32, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out = router(x)
    torch.testing.assert_close(out.gates_NK.sum(1), torch.full((32,), 2.5, dtype=torch.float64))
    scores = torch.sigmoid(x @ router.w_gate.detach()).gather(1, out.experts_NK)
    torch.testing.assert_close(out.gates_NK, 2.5 * scores / scores.sum(1, keepdim=True))
    torch.testing.assert_close(out.aux_loss, 0.3 * cv_squared(out.importance_E))
    router.normalize, router.routed_scaling_factor, router.w_importance = False, 1.0, 0.0
    out = router(x)
    torch.testing.assert_close(out.gates_NK, torch.sigmoid(x @ router.w_gate.detach()).gather(1, out.experts_NK))
    assert float(out.aux_loss) == 0.0


def test_the_config_builds_it_and_defaults_to_no_cv_loss():
    from moe_scale.moe.router import build_router

    config = RunConfig.from_settings(gate="node_limited", num_experts=E, top_k=2, expert_groups=4, group_top_k=2)
    config.resolve_implied_defaults({"gate", "num_experts", "top_k", "expert_groups", "group_top_k"})
    config.validate()
    router = build_router(config.moe.router, D, E, ep_size=2)
    assert (router.groups, router.group_top_k, router.w_importance) == (4, 2, 0.0)
    config.moe.router.node_limited.expert_groups = 0   # one group per expert-parallel rank
    assert build_router(config.moe.router, D, E, ep_size=4).groups == 4


@pytest.mark.parametrize("flags,fragment", [
    (["--expert-groups", "3"], "--expert-groups 3 must divide --num-experts 8"),
    (["--expert-groups", "4", "--group-top-k", "5"], "--group-top-k 5 is more than the --expert-groups 4"),
    (["--expert-groups", "8", "--group-top-k", "1", "--top-k", "2"], "--top-k 2 experts cannot come from 1"),
    (["--routed-scaling-factor", "0"], "--routed-scaling-factor 0 must be a positive number"),
    (["--top-k", "1"], "the one chosen score divided by itself"),
])
def test_bad_settings_are_one_line(flags, fragment, capsys):
    assert cli_main(["train", "--gate", "node_limited", "--num-experts", "8", *flags, *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
