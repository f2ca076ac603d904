"""tools/bench_moe_layer.py end to end at a tiny size: every implementation, the derived ratios, the
working-memory child, the multi-rank mode, and one-line flag errors. (The benchmark's numbers are not
asserted: speed is the tool's job, not the tests'.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moe_scale.distributed.ports import free_port
from tests.paths import TOOLS

BENCH = TOOLS / "bench_moe_layer.py"
TINY = ["--tokens", "64", "--d", "16", "--h", "32", "--repeats", "1", "--min-time", "0", "--warmup", "1",
        "--threads", "1"]
IMPLS = {"dropless", "capacity", "deepspeed_dropless", "deepspeed_capacity", "naive_loop", "dense"}


def _run(*flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    return subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=timeout,
                          env=env)


# Size: 8 experts, k 1 and 2 (both dispatch paths of every implementation), TINY tokens, no memory children.
@pytest.mark.slow
def test_single_process_sweep(tmp_path):
    out_file = tmp_path / "bench.jsonl"
    proc = _run("--experts", "8", "--k", "1,2", *TINY, "--no-memory", "--out", str(out_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in out_file.read_text().splitlines()] == rows
    assert {(r["impl"], r["k"]) for r in rows} == {(impl, k) for impl in IMPLS for k in (1, 2)}
    for r in rows:
        assert r["time_s"] > 0 and r["roofline_s"] > 0
        assert r["roofline_fraction"] == pytest.approx(r["roofline_s"] / r["time_s"], rel=0.01)
        assert r["bound"] in ("compute", "memory") and "working_mib" not in r   # --no-memory: no child
        assert r["bandwidth_then_gbs"] > 0 and r["roofline_fraction_then"] > 0
        assert r["roofline_s"] <= r["serial_bound_s"] <= 2 * r["roofline_s"] and 0.5 <= r["serial_ceiling"] <= 1
        assert r["serial_fraction"] == pytest.approx(r["serial_bound_s"] / r["time_s"], rel=0.01)
        if r["impl"] != "dense":
            assert 1 <= r["experts_used"] <= 8
        if r["impl"] in ("dropless", "capacity"):
            assert r["speedup_vs_deepspeed"] > 0 and r["time_vs_dense"] > 0
    # The roofline counts what each layer must do: DeepSpeed's gate has one matrix, ours two.
    by = {(r["impl"], r["k"]): r for r in rows}
    assert by[("dropless", 2)]["roofline_s"] >= by[("deepspeed_dropless", 2)]["roofline_s"]
    assert by[("naive_loop", 2)]["roofline_s"] == by[("dropless", 2)]["roofline_s"]


# Size: 8 experts, one k, TINY tokens, three implementations (ours, DeepSpeed's and the dense one it is compared
# with: the child is the same for all six); the time is one fresh child process per implementation, the point.
@pytest.mark.slow
def test_working_memory_is_measured_in_a_child_per_implementation():
    """One fresh child process per implementation and k (the sweep above skips them; one k is enough here)."""
    impls = {"dropless", "deepspeed_dropless", "dense"}
    proc = _run("--experts", "8", "--k", "2", "--impls", ",".join(sorted(impls)), *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {r["impl"] for r in rows} == impls
    for r in rows:
        assert r["working_mib"] >= 0
        if r["impl"] == "dropless":
            assert r["working_vs_dense"] >= 0


def test_roofline_counts_the_flops_and_the_weights_of_the_experts_used(load_tool):
    """bound = max(6 x forward multiply-adds / peak, (2 x used + E) x one expert's bytes / bandwidth): the
    forward reads the used experts' weights, the backward reads them again, and every expert's gradient is
    written. By hand at E=64, k=2, 2048 tokens, d=256, h=512: 6 * (2048*2*2*256*512 + 2*2048*256*64) =
    6845104128 FLOPs; one expert is 2*256*512 floats = 1048576 bytes; with 40 experts used,
    (2*40 + 64) * 1048576 = 150994944 bytes. The dense FFN reads all of its weights: 3 x them."""
    bench = load_tool("bench_moe_layer")
    args = bench.parse_args(["--experts", "64", "--k", "2"])
    times = {"dropless": 0.1, "dense": 0.1}
    compute_bound = bench._row("dropless", 64, 2, args, times, 3, {}, peak_flops=1e11, peak_bandwidth=1e12, used=40)
    assert compute_bound["roofline_gflop"] == pytest.approx(6.845104128, rel=1e-3)
    assert compute_bound["roofline_gbytes"] == pytest.approx(0.150994944, rel=1e-3)
    assert compute_bound["bound"] == "compute" and compute_bound["experts_used"] == 40
    assert compute_bound["roofline_s"] == pytest.approx(6845104128 / 1e11, rel=1e-3)
    memory_bound = bench._row("dropless", 64, 2, args, times, 3, {}, peak_flops=1e13, peak_bandwidth=1e9, used=40)
    assert memory_bound["bound"] == "memory"
    assert memory_bound["roofline_s"] == pytest.approx(150994944 / 1e9, rel=1e-3)
    assert memory_bound["roofline_fraction"] == pytest.approx(memory_bound["roofline_s"] / 0.1, rel=1e-3)
    all_used = bench._row("dropless", 64, 2, args, times, 3, {}, peak_flops=1e13, peak_bandwidth=1e9, used=64)
    assert all_used["roofline_gbytes"] == pytest.approx(3 * 0.067108864, rel=1e-3)
    dense = bench._row("dense", 64, 2, args, times, 3, {}, peak_flops=1e13, peak_bandwidth=1e9, used=None)
    dense_weight_bytes = 4 * 2 * 256 * (2 * 512 + 2 * 64)
    assert dense["roofline_gbytes"] == pytest.approx(3 * dense_weight_bytes / 1e9, rel=1e-3)
    assert "experts_used" not in dense
    # The same bound at the bandwidth measured around the layer's steps, when given.
    then = bench._row("dropless", 64, 2, args, times, 3, {}, peak_flops=1e13, peak_bandwidth=1e9, used=40,
                      bandwidth_then=5e8)
    assert then["roofline_fraction"] == pytest.approx(memory_bound["roofline_fraction"], rel=1e-3)
    assert then["bandwidth_then_gbs"] == 0.5
    assert then["roofline_fraction_then"] == pytest.approx(2 * memory_bound["roofline_fraction"], rel=1e-3)


def test_serial_bound_runs_the_router_products_before_the_experts(load_tool):
    """serial bound = router FLOPs / peak + max(expert FLOPs / peak, bytes / bandwidth). By hand at E=64, k=2,
    2048 tokens, d=256, h=512, 40 experts used: the router's 6 * 2 * 2048*256*64 = 402653184 FLOPs, the
    experts' 6 * 2048*2*2*256*512 = 6442450944, the bytes 150994944 (as above)."""
    bench = load_tool("bench_moe_layer")
    args = bench.parse_args(["--experts", "64", "--k", "2"])
    times = {"dropless": 0.5, "deepspeed_dropless": 0.5, "dense": 0.5}
    router_s, experts_s, bytes_s = 402653184 / 1e10, 6442450944 / 1e10, 150994944 / 1e8
    row = bench._row("dropless", 64, 2, args, times, 3, {}, peak_flops=1e10, peak_bandwidth=1e8, used=40)
    assert row["serial_bound_s"] == pytest.approx(router_s + max(experts_s, bytes_s), rel=1e-3)
    assert row["serial_ceiling"] == pytest.approx(max(router_s + experts_s, bytes_s) / (router_s + bytes_s), rel=1e-3)
    assert row["serial_fraction"] == pytest.approx(row["serial_bound_s"] / 0.5, rel=1e-3)
    # The bound's two terms made equal (bytes take router + experts' seconds): the ceiling is
    # (r + x) / (2r + x), which falls to 1/2 as the experts' FLOPs vanish beside the router's.
    balanced_bandwidth = 150994944 / (router_s + experts_s)
    row = bench._row("dropless", 64, 2, args, times, 3, {}, peak_flops=1e10, peak_bandwidth=balanced_bandwidth, used=40)
    assert row["serial_ceiling"] == pytest.approx((router_s + experts_s) / (2 * router_s + experts_s), rel=1e-3)
    # DeepSpeed's gate has one matrix: half the router's FLOPs. The dense FFN has no router: serial = roofline.
    ds = bench._row("deepspeed_dropless", 64, 2, args, times, 3, {}, peak_flops=1e10, peak_bandwidth=1e8, used=40)
    assert ds["serial_bound_s"] == pytest.approx(router_s / 2 + max(experts_s, bytes_s), rel=1e-3)
    dense = bench._row("dense", 64, 2, args, times, 3, {}, peak_flops=1e10, peak_bandwidth=1e8, used=None)
    assert dense["serial_bound_s"] == pytest.approx(dense["roofline_s"], rel=1e-3) and dense["serial_ceiling"] == 1.0


# Routes 16 tokens (k=1) over 64 experts with the benchmark's layer, one step, and prints [the distinct experts
# the router's own output named, experts_used]. A child process: DeepSpeed's layer starts a process group, which
# would otherwise stay up in the test process (its port and MASTER_* settings leaking into later launches).
_EXPERTS_USED_CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import bench_moe_layer as bench
args = bench.parse_args(["--tokens", "16", "--d", "8", "--h", "16", "--gate-logit-std", "1"])
layer = bench.build(sys.argv[2], 64, 1, args)
routed = []
if sys.argv[2].startswith("deepspeed"):   # its gate's outputs end with the tokens per expert
    layer.moe.deepspeed_moe.gate.register_forward_hook(lambda m, i, out: routed.append(int((out[-1] > 0).sum())))
else:
    layer.router.register_forward_hook(lambda m, i, out: routed.append(int(out.experts_NK.unique().numel())))
x, probe = bench.make_inputs(args)
bench.step(layer, x, probe)
print(json.dumps([routed[-1], bench.experts_used(layer), bench.experts_used(bench.build("dense", 64, 1, args))]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["dropless", "capacity", "deepspeed_dropless", "naive_loop"])
def test_experts_used_are_the_experts_the_router_sent_tokens_to(impl, tmp_path):
    """16 tokens, k=1, 64 experts: at most 16 experts get a token, and experts_used counts exactly the
    distinct experts of the step's routing (read from the router's own output); None for the dense FFN."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-c", _EXPERTS_USED_CHECK, str(BENCH.parent), impl], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    routed, used, dense_used = json.loads(proc.stdout.splitlines()[-1])
    assert 1 <= routed <= 16 and used == routed and dense_used is None


# Size: 2 ranks, 8 experts, TINY tokens: the smallest world with an all-to-all to measure.
@pytest.mark.multiprocess
def test_two_ranks_report_the_all_to_all_share():
    proc = _run("--ranks", "2", "--experts", "8", "--k", "2", "--gate-logit-std", "2", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {r["impl"] for r in rows} == {"dropless", "capacity"}
    for r in rows:
        assert r["ranks"] == r["ep_size"] == 2 and r["time_s"] > 0 and 0 < r["all_to_all_share"] < 1
        assert r["gate_logit_std"] == 2


@pytest.mark.parametrize("flags", [["--k", "16", "--experts", "8"], ["--ranks", "3", "--experts", "8"],
                                   ["--impls", "dropless,tutel"], ["--capacity-factor", "0"], ["--tokens", "0"],
                                   ["--out", "/nonexistent/dir/x.jsonl"], ["--gate-logit-std", "-1"],
                                   ["--gate-logit-std", "nan"], ["--capacity-factor", "nan"], ["--min-time", "-1"],
                                   ["--warmup", "0"], ["--dtype", "float8"]]
                         + ([["--device", "cuda"]] if not torch.cuda.is_available() else []))
def test_bad_flags_exit_2_with_one_line(flags, capsys, load_tool):
    bench = load_tool("bench_moe_layer")
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error" in err


def test_gate_logit_std_spreads_our_routers_logits(load_tool):
    """--gate-logit-std S: the clean and the noise logits of the benchmarked layer have std about S (the
    default leaves the paper's zero-initialised gates)."""
    import torch
    bench = load_tool("bench_moe_layer")
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    for std in (0.0, 3.0):
        args = bench.parse_args(["--d", "64", "--h", "32", "--gate-logit-std", str(std)])
        router = bench.build("dropless", 16, 2, args).router
        for weight in (router.w_gate, router.w_noise):
            assert (x @ weight.detach()).std().item() == pytest.approx(std, rel=0.1, abs=1e-12)


@pytest.mark.parametrize("impl", ["dropless", "capacity", "naive_loop", "dense"])
def test_step_gives_the_gradients_of_the_probe_loss(impl, load_tool):
    """The timed step feeds the output gradient in directly; the gradients are those of the loss
    (y * probe).sum() + aux, the layer's own and the input's: with an auxiliary loss (ours) and without (dense).
    (DeepSpeed's layer would start torch.distributed in this process, holding the port later tests launch on.)"""
    import torch
    bench = load_tool("bench_moe_layer")
    args = bench.parse_args(["--tokens", "64", "--d", "16", "--h", "32", "--gate-logit-std", "1"])
    x, probe = bench.make_inputs(args)
    layer = bench.build(impl, 8, 2, args)
    torch.manual_seed(0)   # the noisy gate's noise draws from the global generator: the same noise twice
    bench.step(layer, x, probe)
    fed = [p.grad.clone() for p in layer.parameters() if p.grad is not None] + [x.grad.clone()]
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    torch.manual_seed(0)
    y, aux = layer(x)
    ((y * probe).sum() + aux).backward()
    from_loss = [p.grad for p in layer.parameters() if p.grad is not None] + [x.grad]
    assert len(fed) == len(from_loss) > 1
    for a, b in zip(fed, from_loss):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("repeats, min_time, timed", [(3, 0.0, 3), (3, 1.0, 8), (12, 1.0, 12), (3, 0.9, 8)])
def test_timed_steps_run_the_warmup_then_enough_steps(repeats, min_time, timed, load_tool):
    """--warmup untimed steps, then at least --repeats timed ones and on until they add up to --min-time (a fake
    step of 0.125 s)."""
    bench = load_tool("bench_moe_layer")
    args = bench.parse_args(["--warmup", "2", "--repeats", str(repeats), "--min-time", str(min_time)])
    calls = []

    def one_step():
        calls.append(1)
        return 0.125

    times = bench.timed_steps(one_step, args)
    assert len(times) == timed and len(calls) == 2 + timed


def test_timed_steps_stop_only_when_every_rank_agrees(load_tool):
    """Ranks step together: a rank whose own steps are done goes on while another still wants more."""
    bench = load_tool("bench_moe_layer")
    args = bench.parse_args(["--warmup", "1", "--repeats", "2", "--min-time", "0"])
    other_rank_wants = iter([True, True, False])   # asked once this rank has its 2 steps
    times = bench.timed_steps(lambda: 0.1, args, lambda more: more or next(other_rank_wants))
    assert len(times) == 4


def test_naive_loop_sums_each_tokens_gated_expert_outputs(load_tool):
    """The naive reference layer computes the MoE output: y[t] = sum over t's k experts e of gate * FFN_e(x[t])."""
    import torch
    bench = load_tool("bench_moe_layer")
    args = bench.parse_args(["--tokens", "64", "--d", "16", "--h", "32", "--gate-logit-std", "1"])
    x, _ = bench.make_inputs(args)
    layer = bench.build("naive_loop", 8, 2, args)
    torch.manual_seed(0)   # the same gate noise for the layer and the route below
    y, aux = layer(x)
    torch.manual_seed(0)
    route = layer.router(x)
    expected = torch.stack([sum(gate * layer.experts[e](x[t])
                                for gate, e in zip(route.gates_NK[t], route.experts_NK[t].tolist()))
                            for t in range(x.shape[0])])
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(aux, route.aux_loss)
