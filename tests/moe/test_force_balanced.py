"""--force-balanced-routing (issue 54, part 4): the router runs and its losses count, but the tokens go to the
experts round-robin, so every expert gets the same number of (token, expert) pairs, give or take one; as published
Megatron/NeMo MoE throughputs are measured. Against a per-token reference in float64; the benchmarks, the scaling
sweep, `plan` and `train` say when it was on; gates it cannot apply to refuse it in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe_scale.cli import main as cli_main
from moe_scale.config import MoEConfig
from moe_scale.moe.layer import MoELayer
from tests.cli_runs import FAST, TINY, run_cli, run_train

D, H, E, K, N = 8, 16, 8, 2, 21   # N * K = 42 pairs: 5 or 6 per expert


def _layer(force: bool) -> MoELayer:
    config = MoEConfig()
    config.experts.num_experts, config.experts.hidden, config.router.top_k = E, H, K
    config.router.force_balanced_routing = force
    torch.manual_seed(0)
    layer = MoELayer(config, D, seed=3).double()
    with torch.no_grad():
        layer.router.w_gate.normal_(0.0, 1.0)
    layer.eval()   # no gate noise: the reference recomputes the gates
    return layer


def test_the_pairs_go_round_robin_with_the_routers_gates_and_losses():
    x = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    forced, free = _layer(True), _layer(False)
    free.load_state_dict(forced.state_dict())
    x_forced, x_free = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, aux = forced(x_forced)
    y_free, aux_free = free(x_free)

    # the reference: each token's K round-robin experts, weighted by the router's own top-k gates
    logits = x @ forced.router.w_gate.detach()
    gates = torch.softmax(logits.topk(K, dim=1).values, dim=1)
    w_in, w_out = forced.experts.w_in.detach(), forced.experts.w_out.detach()
    expert = [[(n * K + j) % E for j in range(K)] for n in range(N)]
    reference = torch.stack([sum(gates[n, j] * (torch.relu(x[n] @ w_in[expert[n][j]].t()) @ w_out[expert[n][j]])
                                 for j in range(K)) for n in range(N)]) * math.sqrt(D / H)
    torch.testing.assert_close(y, reference)
    assert all(len(set(e)) == K for e in expert)
    assert torch.equal(aux, aux_free)                        # the router's losses, as without the flag
    assert not torch.allclose(y, y_free)
    assert forced.stats.routed_E.tolist() == [6.0] * 2 + [5.0] * 6   # what the experts received: 42 pairs
    (y.sum() + aux).backward()
    assert forced.router.w_gate.grad is not None and forced.router.w_gate.grad.abs().sum() > 0


def test_it_is_refused_where_it_cannot_apply(capsys):
    for flags, needs in ((["--gate", "batchwise"], "noisy_topk, softmax_topk, aux_free"),
                         (["--gate", "hierarchical", "--num-groups", "4"], "noisy_topk, softmax_topk, aux_free"),
                         (["--layout", "lstm-ffn-lstm"], "an MoE layer")):
        assert cli_main(["train", *flags, "--force-balanced-routing", *FAST]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--force-balanced-routing does nothing here" in err[0] and needs in err[0], err


def test_train_plan_and_the_tools_say_it_was_on(tmp_path, embedded_cache, load_tool):
    run = tmp_path / "run"
    run_train([*TINY, "--max-steps", "2", "--force-balanced-routing", "--out", str(run)], cwd=tmp_path,
              cache=embedded_cache)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["force_balanced_routing"] is True and summary["cv_load"] < 0.02   # 8 x 16 x 2 pairs / 8

    plan = ["plan", "--preset", "lm1b-moe-256", "--nodes", "2", "--gpus-per-node", "8"]
    free = json.loads(run_cli(*plan, "--json", cwd=tmp_path, check=True).stdout)
    forced = json.loads(run_cli(*plan, "--force-balanced-routing", "--json", cwd=tmp_path, check=True).stdout)
    assert (free["force_balanced_routing"], forced["force_balanced_routing"]) == (False, True)
    assert forced["dispatch_load"] == 1 < free["dispatch_load"]   # every rank receives exactly its share
    assert "routing forced balanced" in run_cli(*plan, "--force-balanced-routing", cwd=tmp_path, check=True).stdout

    bench = load_tool("bench_moe_layer")
    args = bench.parse_args(["--experts", "8", "--k", "2", "--impls", "dropless", "--tokens", "64", "--d", "16",
                             "--h", "16", "--force-balanced-routing"])
    layer = bench.build("dropless", 8, 2, args)
    x, probe = bench.make_inputs(args)
    bench.step(layer, x, probe)
    assert layer.force_balanced and layer.stats.routed_E.tolist() == [16.0] * 8
    with pytest.raises(SystemExit):
        bench.parse_args(["--impls", "dropless,naive_loop", "--force-balanced-routing"])

    sweep = load_tool("scaling_sweep")
    rows = [{"ranks": n, "experts": 8, "global_batch": 16, "step_seconds": 0.1, "tokens_per_s": 1e4,
             "tflops_per_device": 1.0, "mfu": 0.1, "all_to_all_share": 0.2, "force_balanced_routing": True,
             "tensorboard": str(tmp_path / f"tb{n}")} for n in (1, 2)]
    report = sweep.markdown("weak", rows, sweep.add_efficiency("weak", rows), tmp_path)
    assert "Routing forced balanced (--force-balanced-routing) in the runs of N = 1, 2" in report
