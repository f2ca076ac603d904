"""The step-time model by hand: all-to-all volume per MoE layer, flat against hierarchical, gradient
synchronisation, compute, overlap and the throughput numbers."""

from __future__ import annotations

import dataclasses

import pytest

from moe_scale.accounting.gpus import get_gpu
from moe_scale.accounting.layout import Layout
from moe_scale.accounting.model_shape import ExpertLayer, planned_model
from moe_scale.accounting.step_time import Network, gradient_sync, layer_all_to_all, step_time
from moe_scale.config import RunConfig

# Round numbers: 100 GB/s inside a node, 10 GB/s between nodes, links used fully.
GPU = dataclasses.replace(get_gpu("h100-sxm"), intra_gbs=100.0, inter_gbs=10.0, link_efficiency=1.0,
                          intra_latency_s=1e-5, inter_latency_s=1e-4, per_peer_latency_s=0.0)
INTRA, INTER = 100e9, 10e9


def test_one_all_to_all_by_hand():
    net = Network(GPU, 4)
    nbytes = 8e6
    # 8 ranks over 2 nodes of 4: 3/8 of the bytes stay in the node, 4/8 cross; both at once, the slower bounds it
    assert net.all_to_all(nbytes, 8, 4) == pytest.approx(1e-4 + max(nbytes * 3 / 8 / INTRA, nbytes * 4 / 8 / INTER))
    assert net.all_to_all(nbytes, 4, 4) == pytest.approx(1e-5 + nbytes * 3 / 4 / INTRA)
    assert net.all_to_all(nbytes, 1, 1) == 0.0


def test_the_volume_of_one_moe_layer_by_hand():
    """Rows of d values: tokens x distinct ranks (at most k) each way, forward and backward (4 moves); per pair an
    8-byte index and a 4-byte gate forward, the gate's gradient back; the counts; 8 calls."""
    layer = ExpertLayer("moe", units=64, picks=4, active=4, hidden=1024)
    layout = Layout(1, 8, ep_size=8)
    tokens, d, value = 4096, 512, 4
    rows = tokens * layer.distinct_ranks(8)
    assert rows < tokens * 4                       # a token's experts on one rank share its row
    volume = 4 * rows * d * value + tokens * 4 * (8 + 4 + 4) + 8 * (64 // 8 + 1) * 8
    seconds, hidden = layer_all_to_all(Network(GPU, 8), layout, layer, tokens, d, value, 64 // 8)
    assert seconds == pytest.approx(8 * 1e-5 + volume * 7 / 8 / INTRA) and hidden == 0.0


def test_hierarchical_against_flat_by_hand():
    layer = ExpertLayer("moe", units=32, picks=2, active=2, hidden=256)
    tokens, d, value = 8192, 1024, 2
    flat, hierarchical = (Layout(4, 8, ep_size=32, all_to_all=a) for a in ("flat", "hierarchical"))
    net = Network(GPU, 8)
    rows = tokens * layer.distinct_ranks(32)
    moves = [32 * 2 * 8, rows * d * value, tokens * 2 * 8, tokens * 2 * 4, rows * d * value, rows * d * value,
             rows * d * value, tokens * 2 * 4]
    # flat: 7/32 of each message inside the node, 24/32 across; hierarchical: 7/8 inside, then 3/4 across
    by_hand_flat = sum(1e-4 + max(m * 7 / 32 / INTRA, m * 24 / 32 / INTER) for m in moves)
    by_hand_hierarchical = sum(1e-5 + m * 7 / 8 / INTRA + 1e-4 + m * 3 / 4 / INTER for m in moves)
    assert layer_all_to_all(net, flat, layer, tokens, d, value, 1)[0] == pytest.approx(by_hand_flat)
    assert layer_all_to_all(net, hierarchical, layer, tokens, d, value, 1)[0] == pytest.approx(by_hand_hierarchical)
    # with a per-peer cost, many small messages favour the two hops (8 + 4 peers instead of 32)
    chatty = Network(dataclasses.replace(GPU, per_peer_latency_s=2e-5), 8)
    assert layer_all_to_all(chatty, hierarchical, layer, 64, d, value, 1)[0] < \
        layer_all_to_all(chatty, flat, layer, 64, d, value, 1)[0]


def test_pieces_hide_the_row_moves_behind_the_experts_by_hand():
    """--a2a-chunks C: the 7 row moves (A) beside the layer's expert compute (X) take max(A, X) + min(A, X) / C,
    with a latency per move and extra piece; exposed = that - X, hidden = A - exposed; the counts stay exposed."""
    layer = ExpertLayer("moe", units=64, picks=4, active=4, hidden=1024)
    layout, net = Layout(1, 8, ep_size=8), Network(GPU, 8)
    tokens, d, value = 4096, 512, 4
    whole, _ = layer_all_to_all(net, layout, layer, tokens, d, value, 8)
    counts = 1e-5 + 8 * 9 * 8 * 7 / 8 / INTRA
    moves = whole - counts
    for chunks, compute in ((2, 10 * moves), (4, 10 * moves), (4, moves / 3)):
        pieces = moves + (chunks - 1) * 7 * 1e-5
        exposed = max(pieces, compute) + min(pieces, compute) / chunks - compute
        got, hidden = layer_all_to_all(net, layout, layer, tokens, d, value, 8, chunks, compute)
        assert got == pytest.approx(counts + exposed) and hidden == pytest.approx(moves - exposed)
    # ample compute: all but a C-th of the moves (and the pieces' latencies) hide
    got, hidden = layer_all_to_all(net, layout, layer, tokens, d, value, 8, 4, 10 * moves)
    assert got == pytest.approx(counts + (moves + 3 * 7 * 1e-5) / 4)
    assert layer_all_to_all(net, layout, ExpertLayer("moa", 8, 2, 2, 16, kv_width=32), tokens, d, value, 1, 4,
                            moves) == layer_all_to_all(net, layout, ExpertLayer("moa", 8, 2, 2, 16, kv_width=32),
                                                       tokens, d, value, 1)   # MoA's exchange is not in pieces


def test_the_plan_reports_how_much_of_the_exchange_the_pieces_hide():
    """Experts wide enough that their products, not the launches, set the compute (a d-32 model's experts take
    microseconds: nothing to hide behind)."""
    def planned(**settings):
        config = RunConfig.from_settings(vocab_size=500, d_model=1024, expert_hidden=4096, num_experts=8, top_k=2,
                                         ep_size=8, **settings)
        config.validate()
        return planned_model(config)
    one = step_time(planned(), Layout(1, 8, ep_size=8), GPU, 8 * 8192, {})
    four = step_time(planned(a2a_chunks=4), Layout(1, 8, ep_size=8), GPU, 8 * 8192, {})
    assert (one["a2a_chunks"], one["all_to_all_hidden_s"], one["all_to_all_hidden_share"]) == (1, 0.0, 0.0)
    assert four["a2a_chunks"] == 4 and 0 < four["all_to_all_hidden_share"] < 1
    assert four["seconds"]["all_to_all"] < one["seconds"]["all_to_all"]
    assert four["seconds"]["all_to_all"] > one["seconds"]["all_to_all"] / 4   # the counts, the pieces' latencies


def _model(**settings):
    config = RunConfig.from_settings(vocab_size=500, d_model=32, expert_hidden=48, num_experts=8, top_k=2,
                                     **settings)
    config.validate()
    return planned_model(config)


def test_gradient_sync_by_hand():
    model = _model()
    net = Network(GPU, 4)
    dense, experts, tables = model.dense_params, model.sharded_params, model.vocab_params
    # ZeRO-0 on 8 GPUs over 2 nodes, ep 4: dense all-reduced over 8, experts over the 2 copies of each, the tables'
    # rows not at all (each lives on one rank)
    reduce, gather = gradient_sync(net, model, Layout(2, 4, ep_size=4))
    assert reduce == pytest.approx(1e-4 + 2 * 7 / 8 * dense * 4 / INTER + 1e-4 + 2 * 1 / 2 * experts / 4 * 4 / INTER)
    assert gather == 0
    # the tables kept whole: all-reduced with the dense parameters
    whole = _model(vocab_exchange="dense")
    reduce, _ = gradient_sync(net, whole, Layout(2, 4, ep_size=4))
    assert reduce == pytest.approx(1e-4 + 2 * 7 / 8 * (dense + tables) * 4 / INTER
                                   + 1e-4 + 2 * 1 / 2 * experts / 4 * 4 / INTER)
    # ZeRO-2 in one node: reduce-scatter of gradients and all-gather of weights, (n-1)/n each
    reduce, gather = gradient_sync(net, model, Layout(1, 4, ep_size=4, zero_stage=2))
    assert reduce == gather == pytest.approx(1e-5 + 3 / 4 * dense * 4 / INTRA)


def test_compute_overlap_and_throughput():
    """Without the launch floor and the small-product curve (tests/accounting/test_kernels.py), the compute is the
    FLOPs at the stated efficiency."""
    model = _model()
    layout = Layout(1, 4, ep_size=4, zero_stage=2)
    tokens = 4096
    gpu = dataclasses.replace(GPU, launch_s=0.0, small_gemm=False)
    plain = step_time(model, layout, gpu, tokens, {"zero_optimization": {"stage": 2}})
    s = plain["seconds"]
    assert s["compute"] == pytest.approx(tokens / 4 * model.flops_per_token / (494.7e12 * 0.35))
    assert s["waiting"] == 0
    assert s["step"] == pytest.approx(s["compute"] + s["all_to_all"] + s["vocab_exchange"] + s["sync"]
                                      + s["gradient_sync"] + s["optimizer"])
    # one router: its statistics (2 x 8 floats) summed forward and backward; the gradient norm once; one node
    assert s["sync"] == pytest.approx(3 * 1e-5 + 2 * 3 / 4 * (2 * 64 / INTRA + 16 / INTRA))
    assert plain["tokens_per_s"] == pytest.approx(tokens / s["step"])
    assert plain["tflops_per_gpu"] == pytest.approx(model.flops_per_token * tokens / 4 / s["step"] / 1e12)
    assert plain["mfu"] == pytest.approx(plain["tflops_per_gpu"] / 494.7)
    overlapped = step_time(model, layout, gpu, tokens, {"zero_optimization": {"stage": 2, "overlap_comm": True}})
    reduce, gather = gradient_sync(Network(gpu, 4), model, layout)
    assert overlapped["seconds"]["gradient_sync"] == pytest.approx(max(0, reduce - s["compute"] * 2 / 3) + gather)
    slow = step_time(model, layout, dataclasses.replace(gpu, straggler=0.25), tokens,
                     {"zero_optimization": {"stage": 2}})["seconds"]
    assert slow["waiting"] == pytest.approx(0.25 * s["compute"])
    assert slow["step"] == pytest.approx(s["step"] + slow["waiting"])
    recompute = step_time(model, dataclasses.replace(layout, recompute=True), gpu, tokens, {})
    assert recompute["seconds"]["compute"] > s["compute"]
    assert recompute["tflops_per_gpu"] < plain["tflops_per_gpu"]    # model FLOPs only: recompute is overhead
