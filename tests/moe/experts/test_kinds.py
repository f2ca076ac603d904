"""The expert-kind registry (moe/experts/kinds.py): every kind answers what the rest of moe_scale asks of it, the
config offers exactly the registered kinds, GeGLU experts equal a dense per-expert reference, the FLOP count is each
kind's, and no module outside the registry tests a kind's name."""

from __future__ import annotations

import re

import pytest
import torch

from moe_scale.accounting.flops import lstm_lm_accounting
from moe_scale.config import EXPERT_KIND_CHOICES, RunConfig
from moe_scale.models.build import build_model
from moe_scale.moe.experts import EXPERT_KINDS, ExpertKind, GroupedExperts, expert_ffn
from moe_scale.moe.shared_experts import SharedExperts
from tests.paths import REPO


def test_the_config_offers_the_registered_kinds_and_the_block_resolves_them():
    assert EXPERT_KIND_CHOICES == ("block", *EXPERT_KINDS)
    assert all(isinstance(kind, ExpertKind) and kind.name == name for name, kind in EXPERT_KINDS.items())
    assert RunConfig().expert_kind == "relu"
    llama = RunConfig.from_settings(model="transformer", block="llama")
    assert llama.expert_kind == llama.block_expert_kind == "swiglu"
    assert RunConfig.from_settings(model="transformer", block="llama", expert_kind="geglu").expert_kind == "geglu"


@pytest.mark.parametrize("name", EXPERT_KINDS)
def test_every_kind_answers_what_is_asked_of_it(name):
    """Widths, parameters = MACs, init per global expert, the dense reference = the grouped function in float64
    (per pair, through the same stacked weights), and the activation's name in transformers for a gated kind."""
    kind = EXPERT_KINDS[name]
    d, f = 6, 10
    experts = GroupedExperts(3, d, f, seed=4, activation=name).double()
    assert experts.w_in.shape == (3, kind.first_width(f), d) and experts.w_out.shape == (3, f, d)
    assert (experts.w_in[0].numel() + experts.w_out[0].numel()) == kind.forward_macs(d, f)
    assert kind.stored_per_hidden() >= 1 and (kind.hf_act is not None) == kind.gated
    other_rank = GroupedExperts(1, d, f, first_global_expert=2, seed=4, activation=name).double()
    assert torch.equal(other_rank.w_in[0], experts.w_in[2])
    x = torch.randn(7, d, dtype=torch.float64)
    counts = [2, 0, 5]
    want = torch.cat([kind.dense(x[:2], experts.w_in[0], experts.w_out[0]),
                      kind.dense(x[2:], experts.w_in[2], experts.w_out[2])]) * experts.output_scale
    torch.testing.assert_close(experts(x, counts), want)
    # the same weights as one shared expert: a routed expert's function
    shared = SharedExperts(d, f, 1, seed=4, first_id=0, activation=name).double()
    if not kind.gated:
        with torch.no_grad():
            shared.w_in.copy_(experts.w_in[0]), shared.w_out.copy_(experts.w_out[0])
    else:
        with torch.no_grad():
            shared.gate_proj.weight.copy_(experts.w_in[0, :f]), shared.up_proj.weight.copy_(experts.w_in[0, f:])
            shared.down_proj.weight.copy_(experts.w_out[0].t())
    torch.testing.assert_close(shared(x[:2]), want[:2])


def test_geglu_equals_a_gelu_gated_loop_in_float64_with_every_gradient():
    counts, index = [2, 0, 3], torch.tensor([0, 3, 1, 2, 0])
    g = torch.Generator().manual_seed(0)
    rows, w_in, w_out = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 3), (3, 8, 3), (3, 4, 3)))
    gate = torch.rand(5, generator=g, dtype=torch.float64) + 0.1
    leaves = [t.requires_grad_(True) for t in (rows, w_in, w_out, gate)]
    got = expert_ffn(*leaves[:3], counts, index, leaves[3], scale=1.0, kernel="loop", kind="geglu")
    x, pieces, start = leaves[0][index], [], 0
    for e, n in enumerate(counts):   # (gelu(x W1ᵀ) * x W3ᵀ) W2ᵀ expert by expert, times the gate, summed per row
        a, b = x[start:start + n] @ leaves[1][e, :4].t(), x[start:start + n] @ leaves[1][e, 4:].t()
        pieces.append((torch.nn.functional.gelu(a) * b) @ leaves[2][e])
        start += n
    want = torch.zeros_like(leaves[0]).index_add(0, index, torch.cat(pieces) * leaves[3][:, None])
    torch.testing.assert_close(got, want)
    upstream = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, leaves, upstream), torch.autograd.grad(want, leaves, upstream)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", EXPERT_KINDS)
def test_flops_counts_each_kinds_experts_as_built(name):
    config = RunConfig.from_settings(d_model=16, expert_hidden=24, num_experts=4, top_k=2, shared_experts=1,
                                     expert_kind=name, vocab_size=50)
    config.validate()
    counts = lstm_lm_accounting(config, 50)
    model = build_model(config, 50)
    assert counts.params["experts"] == sum(p.numel() for p in model.moe.experts.parameters())
    assert counts.params["shared_experts"] == sum(p.numel() for p in model.moe.shared.parameters())
    assert counts.forward_macs["experts"] == 2 * EXPERT_KINDS[name].forward_macs(16, 24)


def test_no_module_outside_the_registry_tests_a_kinds_name():
    names = "|".join(EXPERT_KINDS)
    test = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    found = [f"{path.relative_to(REPO)}:{n}" for path in sorted((REPO / "moe_scale").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if test.search(line)]
    assert not found, found
