"""MoA attention experts (spec §3): shared K/V, top-k gates against a reference loop, k = E as a dense
mixture, the losses' fixed points, DeepSpeed expert wiring, and the paper's MAC/parameter formulas."""

from __future__ import annotations

import math

import pytest
import torch

from moe_scale.attention.moa import MoAAttention
from moe_scale.config import RunConfig
from moe_scale.accounting.attention_flops import mha_macs, moa_macs, moa_params, transformer_forward_macs_per_token

D, d, B, T = 16, 8, 3, 7


def _layer(E=4, k=2, seed=0) -> MoAAttention:
    torch.manual_seed(seed)
    layer = MoAAttention(D, d, E, k, seed=seed)
    with torch.no_grad():   # a router that prefers different experts for different tokens
        layer.router.w_gate.normal_(0, 1.0)
    return layer.eval()


def _reference(layer: MoAAttention, x_BTD: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, straight from spec §3.1 (causal: keys 0..t)."""
    w_q, w_o = layer.experts.w_q, layer.experts.w_o
    probs = torch.softmax(x_BTD @ layer.router.w_gate, dim=-1)
    K, V = layer.k_proj(x_BTD), layer.v_proj(x_BTD)
    out = torch.zeros_like(x_BTD)
    for b in range(x_BTD.shape[0]):
        for t in range(x_BTD.shape[1]):
            top_p, top_e = probs[b, t].topk(layer.k)
            for g, e in zip(top_p, top_e.tolist()):
                q = x_BTD[b, t] @ w_q[e] / math.sqrt(layer.head_dim)
                a = torch.softmax(K[b, : t + 1] @ q, dim=0)
                out[b, t] += g * ((a @ V[b, : t + 1]) @ w_o[e])
    return out


def test_top_k_selection_and_gates_match_reference_loop():
    layer = _layer(E=5, k=2)
    x = torch.randn(B, T, D)
    y, _ = layer(x)
    torch.testing.assert_close(y, _reference(layer, x), rtol=1e-5, atol=1e-5)


def test_k_equal_E_is_the_dense_mixture():
    E = 4
    layer = _layer(E=E, k=E)
    x = torch.randn(B, T, D)
    y, _ = layer(x)
    probs_BTE = torch.softmax(x @ layer.router.w_gate, dim=-1)
    K, V = layer.k_proj(x), layer.v_proj(x)
    q_BTEd = torch.einsum("btd,edh->bteh", x, layer.experts.w_q) / math.sqrt(d)
    scores_BEtu = torch.einsum("bteh,buh->betu", q_BTEd, K)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    attn = torch.softmax(scores_BEtu.masked_fill(~causal, float("-inf")), dim=-1)
    o_BTEd = torch.einsum("betu,buh->bteh", attn, V)
    dense = torch.einsum("bte,bteh,ehd->btd", probs_BTE, o_BTEd, layer.experts.w_o)
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-5)


def test_shared_kv_computed_once_per_forward():
    layer = _layer(E=4, k=3)
    calls = []
    layer.k_proj.register_forward_hook(lambda m, i, o: calls.append(("k", tuple(o.shape))))
    layer.v_proj.register_forward_hook(lambda m, i, o: calls.append(("v", tuple(o.shape))))
    layer(torch.randn(B, T, D))
    assert calls == [("k", (B, T, d)), ("v", (B, T, d))]    # once each, for whole sequences, k=3 slots


def test_loss_fixed_points_uniform_router():
    E = 8
    layer = _layer(E=E, k=2)
    with torch.no_grad():
        layer.router.w_gate.zero_()   # uniform p: L_a = 1 whatever the selection, L_z(0) = (ln E)^2
    layer(torch.randn(B, T, D))
    assert layer.stats.metrics["switch_loss"] == pytest.approx(1.0, abs=1e-6)
    assert layer.stats.metrics["z_loss"] == pytest.approx(math.log(E) ** 2, rel=1e-6)
    assert math.log(8) ** 2 == pytest.approx(4.3241, abs=1e-4)


def test_collapsed_router_switch_loss_is_E():
    E = 4
    layer = _layer(E=E, k=1)
    with torch.no_grad():
        layer.router.w_gate.zero_()
        layer.router.w_gate[0, 2] = 1e4   # every token with x_0 > 0 goes to expert 2 with p ≈ 1
    x = torch.randn(B, T, D)
    x[..., 0] = x[..., 0].abs() + 0.1
    layer(x)
    assert layer.stats.metrics["switch_loss"] == pytest.approx(E, rel=1e-4)


def test_attention_experts_are_deepspeed_expert_parameters_and_round_trip():
    layer = _layer(E=4, k=2)
    for p in layer.experts.parameters():
        assert p.allreduce is False and p.group_name == "ep_size_1"
    for p in (layer.k_proj.weight, layer.router.w_gate):
        assert not hasattr(p, "allreduce")
    state = layer.state_dict()
    expert_keys = sorted(k for k in state if "expert" in k)
    assert expert_keys == sorted(f"deepspeed_moe.experts.deepspeed_experts.{i}.{n}" for i in range(4)
                                 for n in ("w_q", "w_o"))
    other = _layer(E=4, k=2, seed=1)
    other.load_state_dict(state)
    x = torch.randn(B, T, D)
    torch.testing.assert_close(other(x)[0], layer(x)[0])


def test_expert_init_does_not_depend_on_the_rank_that_holds_it():
    whole = MoAAttention(D, d, 4, 2, seed=3)
    second_half = MoAAttention(D, d, 4, 2, ep_size=2, ep_rank=1, seed=3)
    torch.testing.assert_close(second_half.experts.w_q, whole.experts.w_q[2:])
    torch.testing.assert_close(second_half.experts.w_o, whole.experts.w_o[2:])


# Spec §3.5: MoA MACs (eq. 18) inserted in Transformer-base (604M, 18 attention modules, T = 10, d_m = 512).
@pytest.mark.parametrize("k, E, dh, table", [(8, 8, 128, 628e6), (8, 8, 256, 841e6), (8, 32, 64, 524e6),
                                             (8, 32, 128, 631e6), (4, 32, 256, 654e6), (16, 32, 256, 1220e6)])
def test_macs_eq18_reproduce_table3(k, E, dh, table):
    assert mha_macs(10, 512) == pytest.approx(10.54e6, rel=1e-3)
    derived = 604e6 - 18 * mha_macs(10, 512) + 18 * moa_macs(10, 512, dh, k)
    assert derived == pytest.approx(table, rel=0.01)


@pytest.mark.parametrize("E, dh, table", [(8, 256, 87e6), (16, 256, 125e6), (32, 64, 83e6), (32, 128, 123e6),
                                          (32, 256, 200e6)])
def test_params_eq20_reproduce_table3(E, dh, table):
    non_attention = 65e6 - 18 * moa_params(8, 512, 128)
    assert abs(non_attention + 18 * moa_params(E, 512, dh) - table) < 1.3e6


def test_model_parameters_and_macs_match_eq18_20():
    m = RunConfig.from_settings(model="transformer", attention="moa", d_model=D, head_dim=d, moa_num_experts=6,
                                moa_top_k=2)
    layer = MoAAttention(D, d, 6, 2)
    assert sum(p.numel() for p in layer.parameters()) == moa_params(6, D, d)     # eq. 20 + router
    per_token = transformer_forward_macs_per_token(m, vocab_size=100, seq_len=T)["attention"]
    assert per_token == m.model.transformer.num_layers * (moa_macs(T, D, d, 2) // T + D * 6)


def test_one_rank_forward_and_backward_read_nothing_from_the_device():
    """As a GPU dispatches it (gpu_decisions): the top-k gate gives every token its k rows, so one rank's dispatch
    needs no counts; forward and backward make no host-blocking read, and the output is the reference's."""
    from op_count import OpCounter
    from moe_scale.moe.kernel_policy import gpu_decisions

    layer = _layer().train()
    layer.dropout = 0.0
    x = torch.randn(B, T, D, requires_grad=True)
    with gpu_decisions(), OpCounter() as counter:
        y, aux = layer(x)
        (y.square().sum() + aux).backward()
    assert counter.host_syncs == 0, dict(counter.syncs)
    torch.testing.assert_close(y, _reference(layer, x), rtol=1e-5, atol=1e-5)
