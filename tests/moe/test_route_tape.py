"""Router replay (issue 54, part 2; moe/route_tape.py): a layer routed by a record takes the record's experts with
gates from its live router's scores (a replayed expert the router would not pick still gets a gradient); replaying
a run's own record gives bit-identical losses and weights, also with --expert-recompute, across a resume, and on
another --ep-size; records of another model or other data, or that end too early, are refused in one line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from moe_scale.config import MoEConfig
from moe_scale.moe.layer import MoELayer
from moe_scale.moe.route_tape import open_tape, read_routes
from tests.cli_runs import TINY, assert_one_line_error, run_cli, run_train, step_log
from tests.multiproc import run_ranks

D, H, E, K, N = 8, 16, 8, 2, 12


def _layer(ep_size: int = 1, ep_rank: int = 0) -> MoELayer:
    config = MoEConfig()
    config.experts.num_experts, config.experts.hidden, config.router.top_k = E, H, K
    config.router.gate, config.router.softmax_topk.renormalize = "softmax_topk", "full"
    torch.manual_seed(0)
    layer = MoELayer(config, D, ep_size=ep_size, ep_rank=ep_rank, seed=3).double()
    with torch.no_grad():
        layer.router.w_gate.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(4))
    return layer


def _batch(rank: int = 0, world: int = 1):
    x = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    n = N // world
    return x[rank * n:(rank + 1) * n].clone().requires_grad_(True)


def _forward(layer, tape, x, step=0):
    tape.at("train", step)
    y, aux = layer(x)
    tape.clear()
    (y.square().sum() + aux).backward()
    tape.flush()
    return y.detach(), {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}


def _tape(layer, directory, mode, rank=0, world=1):
    record, replay = (directory, None) if mode == "record" else (None, directory)
    return open_tape([layer], "softmax_topk", record, replay, rank, world, {"data": 1})


def test_replaying_the_own_record_is_bit_identical(tmp_path):
    layer = _layer()
    y, grads = _forward(layer, _tape(layer, tmp_path / "rec", "record"), _batch())
    again = _layer()
    y2, grads2 = _forward(again, _tape(again, tmp_path / "rec", "replay"), _batch())
    assert torch.equal(y, y2) and grads.keys() == grads2.keys()
    assert all(torch.equal(grads[name], grads2[name]) for name in grads)
    [entry] = list(read_routes(tmp_path / "rec"))
    assert (entry["phase"], entry["step"], entry["micro"], entry["layer"]) == ("train", 0, 0, 0)
    assert entry["experts"].shape == (N, K) and entry["experts"].dtype == np.int16


def test_other_experts_take_the_live_gates_and_give_the_router_a_gradient(tmp_path):
    layer = _layer()
    _forward(layer, _tape(layer, tmp_path / "rec", "record"), _batch())
    chosen = next(read_routes(tmp_path / "rec"))["experts"].astype(np.int64)
    other = (chosen + 3) % E   # experts the router did not pick
    data = np.memmap(tmp_path / "rec" / "rank0.bin", dtype="<i2", mode="r+")
    data[:] = other.reshape(-1)
    data.flush()
    replayed = _layer()
    x = _batch()
    y, grads = _forward(replayed, _tape(replayed, tmp_path / "rec", "replay"), x)
    # the reference: the replayed experts' live gates, through the router's weights; its own balance loss
    replayed.zero_grad()
    replayed.router.keep_scores = False
    w_gate = replayed.router.w_gate
    probs = torch.softmax(x.detach() @ w_gate, dim=1)
    gates = probs.gather(1, torch.from_numpy(other))
    gates = gates / gates.sum(1, keepdim=True)
    w_in, w_out = replayed.experts.w_in.detach(), replayed.experts.w_out.detach()
    reference = torch.stack([sum(gates[n, j] * (torch.relu(x.detach()[n] @ w_in[other[n, j]].t()) @ w_out[other[n, j]])
                                 for j in range(K)) for n in range(N)]) * math.sqrt(D / H)   # ReLU experts
    torch.testing.assert_close(y, reference.detach())
    (reference.square().sum() + replayed.router(x.detach()).aux_loss).backward()
    torch.testing.assert_close(grads["router.w_gate"], w_gate.grad)
    assert (other != chosen).all()


def test_records_of_another_model_or_too_short_and_gates_that_cannot_replay_are_refused(tmp_path):
    from moe_scale.errors import UserError
    from moe_scale.moe.router import NoisyTopKRouter, SoftmaxTopKRouter
    from tests.moe.layers import moe_layer

    layer = _layer()
    _forward(layer, _tape(layer, tmp_path / "rec", "record"), _batch())
    other = moe_layer(D, H, 4, K, router=SoftmaxTopKRouter(D, 4, K))
    with pytest.raises(UserError, match="recorded for another model"):
        open_tape([other], "softmax_topk", None, tmp_path / "rec", 0, 1, {"data": 1})
    with pytest.raises(UserError, match="recorded for other data"):
        open_tape([_layer()], "softmax_topk", None, tmp_path / "rec", 0, 1, {"data": 2})
    replayed = _layer()
    tape = _tape(replayed, tmp_path / "rec", "replay")
    tape.at("train", 1)
    with pytest.raises(UserError, match="no recorded routes for train step 1, micro-batch 0, routed layer 0"):
        replayed(_batch())
    noisy = moe_layer(D, H, E, K, router=NoisyTopKRouter(D, E, K))
    with pytest.raises(UserError, match="the noisy_topk gate cannot be replayed"):
        open_tape([noisy], "noisy_topk", None, tmp_path / "rec", 0, 1, {"data": 1})
    assert open_tape([noisy], "noisy_topk", tmp_path / "noisy-rec", None, 0, 1, {"data": 1}) is not None   # records


def _replay_worker(rank, world, directory):
    layer = _layer(world, rank)
    layer.set_deepspeed_parallelism()
    y, grads = _forward(layer, _tape(layer, directory, "replay", rank, world), _batch(rank, world))
    return y


@pytest.mark.multiprocess
def test_a_record_of_two_data_parallel_ranks_replays_on_two_expert_parallel_ranks(tmp_path):
    """The same per-rank tokens (two processes), the experts spread over them: the same outputs."""
    for rank in range(2):
        layer = _layer()
        _forward(layer, _tape(layer, tmp_path / "rec", "record", rank, 2), _batch(rank, 2))
    want = []
    for rank in range(2):
        layer = _layer()
        want.append(_forward(layer, _tape(layer, tmp_path / "rec", "replay", rank, 2), _batch(rank, 2))[0])
    got = run_ranks(_replay_worker, world_size=2, args=(tmp_path / "rec",), deepspeed=True, timeout=90)
    for rank in range(2):
        torch.testing.assert_close(got[rank], want[rank])


ROUTED = [*TINY, "--gate", "softmax_topk", "--dropout", "0", "--log-interval", "1", "--eval-interval", "100",
          "--checkpoint-interval", "2", "--keep-checkpoints", "0"]


@pytest.mark.slow   # 8 small runs
def test_a_runs_own_record_replays_bit_identically_with_recompute_across_a_resume_and_refuses_others(
        tmp_path, embedded_cache):
    def train(name, *flags):
        run_train([*ROUTED, "--max-steps", "4", *flags, "--out", str(tmp_path / name)], cwd=tmp_path,
                  cache=embedded_cache)
        return [r["loss"] for r in step_log(tmp_path / name)]

    record = tmp_path / "routes"
    losses = train("recorded", "--record-routes", str(record))
    assert len(list(read_routes(record))) == 4 and json.loads((record / "routes.json").read_text())["format"] == 1
    assert train("replayed", "--replay-routes", str(record)) == losses
    run_train([*ROUTED, "--max-steps", "2", "--replay-routes", str(record), "--expert-recompute", "--out",
               str(tmp_path / "resumed")], cwd=tmp_path, cache=embedded_cache)
    run_train(["--resume", "--max-steps", "4", "--out", str(tmp_path / "resumed")], cwd=tmp_path,
              cache=embedded_cache)
    assert [r["loss"] for r in step_log(tmp_path / "resumed")] == losses
    summaries = [json.loads((tmp_path / n / "summary.json").read_text()) for n in ("recorded", "resumed")]
    assert summaries[0]["valid_ppl"] == summaries[1]["valid_ppl"] and math.isfinite(summaries[0]["valid_ppl"])

    proc = run_cli("train", *ROUTED, "--max-steps", "4", "--seed", "7", "--replay-routes", str(record), "--out",
                   str(tmp_path / "refused"), cwd=tmp_path, cache=embedded_cache)
    assert_one_line_error(proc, f"--replay-routes {record}", "recorded for other data (its seed differ)")
    assert not (tmp_path / "refused").exists()

    # eval records and replays its own batches; generate records its decoding steps
    recorded = tmp_path / "recorded"
    evals = [json.loads(run_cli("eval", "--run", str(recorded), "--json", flag, str(tmp_path / "eval-routes"),
                                cwd=tmp_path, cache=embedded_cache, check=True).stdout)
             for flag in ("--record-routes", "--replay-routes")]
    assert evals[0]["ppl"] == evals[1]["ppl"]
    assert {r["phase"] for r in read_routes(tmp_path / "eval-routes")} == {"eval"}
    run_cli("generate", "--run", str(recorded), "--max-new-tokens", "3", "--greedy", "--record-routes",
            str(tmp_path / "generate-routes"), cwd=tmp_path, cache=embedded_cache, check=True)
    assert [r["step"] for r in read_routes(tmp_path / "generate-routes")] == [0, 1, 2]

