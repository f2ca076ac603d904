"""A regular training step, as a GPU runs it (tools/step_syncs.py, tools/count_step_syncs.py): no host
read but the one count read per MoE layer an expert-parallel exchange needs, so the reads cannot creep back."""

from __future__ import annotations

import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest

import step_syncs
from tests.cli_runs import run_cli
from tests.paths import REPO

GPU_CONFIGS = [REPO / "ds_configs" / "gpu_bf16_zero2.json", REPO / "ds_configs" / "gpu_bf16_zero1.json"]
# Small in width and depth: the counts depend on the number of layers, experts and ranks, not on d or h.
TRANSFORMER = ["--model", "transformer", "--ffn", "moe", "--num-layers", "2", "--num-heads", "2", "--num-experts", "8",
               "--top-k", "2", "--seq-len", "8", "--batch-size", "4", "--dropout", "0.0"]
LSTM = ["--num-experts", "8", "--top-k", "2", "--seq-len", "8", "--batch-size", "4", "--dropout", "0.0"]
# An expert hidden width twice d: the ReLU experts' output scale sqrt(d / h) is then not 1, as at a GPU's widths (a
# scale of 1 skips a multiplication per MoE layer each way).
WIDTH = ["--d-model", "16", "--expert-hidden", "32"]


def count(tmp_path, flags: list[str], cache, nprocs: int = 1) -> list[dict]:
    """Each rank's report of `moe-scale train FLAGS`' step step_syncs.COUNTED_STEP."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    report = tmp_path / "report.json"
    run_cli(str(report), str(tmp_path / "run"), *flags, cwd=tmp_path, cache=cache, nprocs=nprocs,
            entry=step_syncs.main, check=True)
    files = [report] if nprocs == 1 else [report.with_name(f"report.json.rank{r}") for r in range(nprocs)]
    return [json.loads(f.read_text()) for f in files]


def where(report: dict) -> list[str]:
    return [f"{r['count']} x {r['kind']} at {r['site']}" for r in report["reads"]]


@pytest.mark.parametrize("model, config, most_ops", [(TRANSFORMER, GPU_CONFIGS[0], 460), (LSTM, GPU_CONFIGS[1], 265)],
                         ids=["transformer-zero2", "lstm-zero1"])
def test_one_rank_step_reads_nothing(tmp_path, embedded_cache, model, config, most_ops):
    """... and launches no more kernels than it did when the 8-layer step came to 1,485 (docs/gpu.md): 455 for
    these 2 layers, 260 for the LSTM-MoE with its LSTMs counted as cuDNN's kernels, not this CPU's (a little room
    for DeepSpeed's own), so they cannot creep back either."""
    (report,) = count(tmp_path, [*model, *WIDTH, "--ds-config", str(config)], embedded_cache)
    assert report["host_reads"] == 0 and report["all_to_all_count_reads"] == 0, where(report)
    assert report["reads"] == [] and report["host_side_reads"] == []
    assert report["kernel_ops"] == sum(p["kernel_ops"] for p in report["phases"].values())
    assert all(report["phases"][p]["kernel_ops"] > 0 for p in step_syncs.PHASES), report["phases"]
    assert report["kernel_ops"] <= most_ops, report["phases"]


def test_the_counter_finds_what_deepspeeds_defaults_read(tmp_path, embedded_cache):
    """The GPU config before its choices (docs/gpu.md): each read DeepSpeed's defaults make, where it is made."""
    old = json.loads(GPU_CONFIGS[0].read_text())
    old["bf16"] = {"enabled": True}
    old["zero_optimization"]["overlap_comm"] = True
    del old["timers"]
    config = tmp_path / "defaults.json"
    config.write_text(json.dumps(old))
    (report,) = count(tmp_path, [*TRANSFORMER, *WIDTH, "--ds-config", str(config)], embedded_cache)
    sites = {(r["kind"], r["site"].split(":")[0], r["site"].split(" ")[-1]): r["count"] for r in report["reads"]}
    assert sites == {
        ("accelerator.synchronize", "deepspeed/utils/timer.py", "ThroughputTimer.start"): 1,
        ("accelerator.synchronize", "deepspeed/utils/timer.py", "ThroughputTimer.stop"): 1,
        ("accelerator.synchronize", "deepspeed/runtime/zero/stage_1_and_2.py",
         "DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue"): 1,   # overlap_comm
        ("_local_scalar_dense", "deepspeed/runtime/zero/stage_1_and_2.py", "DeepSpeedZeroOptimizer.has_overflow"): 1,
        ("_local_scalar_dense", "deepspeed/runtime/utils.py", "is_invalid_grad_norm"): 1,   # check_grad_overflow
    }, where(report)
    assert report["host_reads"] == 5 and {r["phase"] for r in report["reads"]} == {"forward", "backward", "optimizer"}


@pytest.mark.slow
def test_counts_do_not_depend_on_the_width(tmp_path, embedded_cache):
    """What tools/count_step_syncs.py's small default width stands for: the GPU's d and h give the same counts."""
    flags = [*TRANSFORMER, "--ds-config", str(GPU_CONFIGS[0])]
    narrow, = count(tmp_path / "a", [*flags, *WIDTH], embedded_cache)
    wide, = count(tmp_path / "b", [*flags, "--d-model", "64", "--expert-hidden", "160"], embedded_cache)
    assert narrow["phases"] == wide["phases"] and narrow["host_reads"] == wide["host_reads"] == 0


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=["zero2", "zero1"])
def test_two_ranks_read_only_the_exchanges_counts(tmp_path, embedded_cache, config):
    """Expert-parallel over both ranks: one count read per MoE layer, in the forward, at the exchange, and one for
    each vocabulary table's exchange (the embedding's rows; the softmax's hidden states: the tables are split over
    the processes); nothing else on either rank but the stop-request flag, a CPU tensor on GPUs too. Data-parallel
    only (ep_size 1): the tables' two reads, nothing else. The exchange in 4 overlapped pieces (--a2a-chunks) reads
    what one piece reads. With capacity dispatch (fixed-size slots) and whole
    vocabulary tables, under ZeRO 1: no read at all. The hierarchical gate with --etp-size 2 (its secondary gates
    copied on both ranks, their noise and gradients summed over them): the reads of expert parallelism."""
    flags = [*TRANSFORMER, *WIDTH, "--ds-config", str(config)]
    if config == GPU_CONFIGS[1]:
        for rank, report in enumerate(count(tmp_path / "etp", [*flags, "--gate", "hierarchical", "--num-groups", "2",
                                                               "--etp-size", "2"], embedded_cache, nprocs=2)):
            assert report["host_reads"] == 0 and report["all_to_all_count_reads"] == 4, (rank, where(report))
            assert [r["site"].split(" ")[-1] for r in report["reads"]] == ["_read_counts"] * 2 + ["_read_to_host"]
        for rank, report in enumerate(count(tmp_path / "capacity", [*flags, "--ep-size", "2", "--dispatch", "capacity",
                                                                    "--vocab-exchange", "dense"], embedded_cache,
                                            nprocs=2)):
            assert report["host_reads"] == 0 and report["all_to_all_count_reads"] == 0, (rank, where(report))
            assert [r["site"].split(" ")[-1] for r in report["host_side_reads"]] == ["StopRequests.agreed"]
        return
    # (in 4 overlapped pieces: the reads of one)
    for rank, report in enumerate(count(tmp_path / "ep2", [*flags, "--ep-size", "2", "--a2a-chunks", "4"],
                                        embedded_cache, nprocs=2)):
        assert report["host_reads"] == 0 and report["all_to_all_count_reads"] == 4, (rank, where(report))
        assert [(r["phase"], r["site"].split(":")[0], r["site"].split(" ")[-1], r["count"], r["all_to_all"])
                for r in report["reads"]] == \
            [("forward", "moe_scale/models/vocab_parallel.py", "_read_counts", 1, True)] * 2 + \
            [("forward", "moe_scale/moe/dispatch/exchange.py", "_read_to_host", 2, True)], where(report)
        assert [r["site"].split(" ")[-1] for r in report["host_side_reads"]] == ["StopRequests.agreed"]
    for rank, report in enumerate(count(tmp_path / "ep1", [*flags, "--ep-size", "1"], embedded_cache, nprocs=2)):
        assert report["host_reads"] == 0 and report["all_to_all_count_reads"] == 2, (rank, where(report))
