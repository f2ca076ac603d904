"""2 processes through the deepspeed launcher (gloo, expert parallelism) against 1 process, same global batch.

Gate noise is drawn per global token and dropout is off, so the two runs must take the same steps. The
clip threshold is below the gradient norm, so a wrong norm under expert parallelism would show as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cli_runs import TINY, run_eval, run_train, step_log
from tests.paths import DS_CONFIGS

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _clip_config(tmp_path, name: str, clip: float):
    source = json.loads((DS_CONFIGS / f"{name}.json").read_text())
    source["gradient_clipping"] = clip
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(source))
    return path


@pytest.mark.parametrize("ds_name", ["zero2_ep", "zero1_ep", "cpu"])
def test_two_processes_expert_parallel_equal_one_process(tmp_path, embedded_cache, ds_name):
    ds = _clip_config(tmp_path, ds_name, clip=0.5)
    common = [*TINY, "--noise-rng", "global", "--dropout", "0", "--lr", "0.01", "--warmup-steps", "0",
              "--max-steps", "5", "--eval-interval", "5", "--checkpoint-interval", "5", "--ds-config", str(ds)]
    one, two = tmp_path / "one", tmp_path / "two"
    run_train([*common, "--out", str(one)], cwd=tmp_path, cache=embedded_cache)
    run_train([*common, "--ep-size", "2", "--out", str(two)], cwd=tmp_path, cache=embedded_cache, nprocs=2)
    single, double = step_log(one), step_log(two)
    assert len(single) == len(double) == 5
    assert all(r["grad_norm"] > 0.5 for r in single)          # clipping was active on every step
    for a, b in zip(single, double):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5), (a, b)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-4, abs=1e-7), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)
    assert single[-1]["loss"] < single[0]["loss"]              # it trained
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ep_size"] == 2
    # tokens routed per expert are summed over the ranks: the heatmaps' numbers equal one process's
    assert (one / "expert_load.jsonl").read_text() == (two / "expert_load.jsonl").read_text()
    # the 2-rank checkpoint (one file per global expert) evaluates in one process like the 1-rank one
    assert run_eval(["--run", str(two)], cwd=tmp_path, cache=embedded_cache)["ppl"] == pytest.approx(
        run_eval(["--run", str(one)], cwd=tmp_path, cache=embedded_cache)["ppl"], rel=1e-4)


def _one_and_two_processes(tmp_path, embedded_cache, common: list[str]):
    """`common` on 1 process and on 2 with --ep-size 2: every step's loss and aux loss and the validation
    perplexity equal; (the two runs, their summaries)."""
    one, two = tmp_path / "one", tmp_path / "two"
    run_train([*common, "--out", str(one)], cwd=tmp_path, cache=embedded_cache)
    run_train([*common, "--ep-size", "2", "--out", str(two)], cwd=tmp_path, cache=embedded_cache, nprocs=2)
    for a, b in zip(step_log(one), step_log(two), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5), (a, b)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-4, abs=1e-6), (a, b)
    first, second = (json.loads((run / "summary.json").read_text()) for run in (one, two))
    assert second["valid_ppl"] == pytest.approx(first["valid_ppl"], rel=1e-4)
    return one, two, first, second


@pytest.mark.parametrize("gate_flags", [
    ["--gate", "hierarchical", "--num-groups", "2", "--top-k", "2", "--top-k-secondary", "2",
     "--expert-kind", "geglu"],   # (and GeGLU experts)
    ["--gate", "batchwise", "--batchwise-scope", "global",
     "--softmax", "adaptive", "--adaptive-cutoffs", "50,200"],   # (and the adaptive softmax's tails split by rows)
    ["--gate", "softmax_topk", "--vocab-exchange", "dense"],   # (and the vocabulary tables whole on every rank)
    ["--gate", "aux_free", "--bias-update-rate", "0.01", "--seq-balance-weight", "0.01", "--shared-experts", "1",
     "--shared-expert-gate"],
], ids=["hierarchical", "batchwise", "softmax_topk", "aux_free_shared"])
def test_every_gate_two_processes_equal_one_process(tmp_path, embedded_cache, gate_flags):
    common = [*TINY, *gate_flags, "--noise-rng", "global", "--dropout", "0", "--lr", "0.01", "--warmup-steps", "0",
              "--max-steps", "4", "--eval-interval", "4", "--checkpoint-interval", "4",
              "--ds-config", str(DS_CONFIGS / "zero2_ep.json")]
    one, two, first, second = _one_and_two_processes(tmp_path, embedded_cache, common)
    assert second["cv_load"] == pytest.approx(first["cv_load"], rel=1e-3, abs=1e-6)
    # the validation pass's balance (real tokens only: the padding mask travels with the rows)
    assert second["valid_cv_load"] == pytest.approx(first["valid_cv_load"], rel=1e-3, abs=1e-6)
    assert second["valid_cv_importance"] == pytest.approx(first["valid_cv_importance"], rel=1e-3, abs=1e-6)
    if "bias_spread" in first:   # aux_free: each rank moved its biases by the whole batch's load
        assert second["bias_spread"] == pytest.approx(first["bias_spread"], rel=1e-6) and first["bias_spread"] > 0


def _runs_take_the_steps_of_one(tmp_path, embedded_cache, common: list[str], runs: dict, grad_norm: bool = False):
    """`common` with each run's (flags, processes); every run's steps equal run "one"'s: loss and aux loss (and
    the gradient norm); returns the step logs by run."""
    logs = {}
    for name, (flags, nprocs) in runs.items():
        run_train([*common, *flags, "--out", str(tmp_path / name)], cwd=tmp_path, cache=embedded_cache, nprocs=nprocs)
        logs[name] = step_log(tmp_path / name)
    for name in set(runs) - {"one"}:
        for a, b in zip(logs["one"], logs[name], strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5), (name, a, b)
            assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-4, abs=1e-7), (name, a, b)
            assert not grad_norm or b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (name, a, b)
    return logs


def test_four_processes_ep4_hierarchical_and_ep2_by_dp2_equal_one_process(tmp_path, embedded_cache):
    """ep_size 4 with the two-hop all-to-all (2 'nodes' of 2 ranks, ZeRO-2), and ep_size 2 x data-parallel 2
    (ZeRO-1), against one process on the same global batch."""
    configs = DS_CONFIGS
    common = [*TINY, "--noise-rng", "global", "--dropout", "0", "--lr", "0.01", "--warmup-steps", "0",
              "--max-steps", "3", "--eval-interval", "3", "--checkpoint-interval", "3"]
    runs = {"one": ([], 1),
            "ep4_hier": (["--ep-size", "4", "--all-to-all", "hierarchical", "--node-size", "2",
                          "--ds-config", str(configs / "zero2_ep.json")], 4),
            "ep2_dp2": (["--ep-size", "2", "--ds-config", str(configs / "zero1_ep.json")], 4)}
    _runs_take_the_steps_of_one(tmp_path, embedded_cache, common, runs)
    assert json.loads((tmp_path / "ep4_hier" / "summary.json").read_text())["world_size"] == 4


def test_capacity_mode_is_independent_of_expert_parallelism(tmp_path, embedded_cache):
    """Capacity is per sending rank, so 2 data-parallel ranks drop the same copies with or without
    expert parallelism; a factor of 0.5 makes them drop some."""
    common = [*TINY, "--dispatch", "capacity", "--capacity-factor", "0.5", "--noise-rng", "global",
              "--dropout", "0", "--lr", "0.01", "--warmup-steps", "0", "--max-steps", "3", "--log-interval", "1",
              "--eval-interval", "3", "--checkpoint-interval", "3",
              "--ds-config", str(DS_CONFIGS / "zero2_ep.json")]
    dp, ep = tmp_path / "dp", tmp_path / "ep"
    shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    run_train([*common, "--out", str(dp)], cwd=tmp_path, cache=embedded_cache, nprocs=2)
    run_train([*common, "--ep-size", "2", "--out", str(ep)], cwd=tmp_path, cache=embedded_cache, nprocs=2)
    # DeepSpeed's CPU all-reduce workspace (66 MB per rank) is not left behind in /dev/shm.
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= shm_before
    for a, b in zip(step_log(dp), step_log(ep), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5), (a, b)
    first, second = (json.loads((run / "summary.json").read_text()) for run in (dp, ep))
    assert 0.2 < first["dropped_fraction"] < 1.0                 # at least half the copies cannot fit
    assert second["dropped_fraction"] == pytest.approx(first["dropped_fraction"])


def test_llama_block_two_processes_expert_parallel_equal_one_process_and_import_their_experts(tmp_path,
                                                                                             embedded_cache):
    """--block llama (SwiGLU experts behind Mixtral's router, tied embeddings under ZeRO-2) takes the same steps on
    1 process and on 2 with --ep-size 2; a 2-process run started --init-from-hf an export (each rank importing its
    experts) exports the same tensors again (--lr 0)."""
    from safetensors.torch import load_file

    from tests.cli_runs import run_cli

    common = [*TINY, "--model", "transformer", "--block", "llama", "--ffn", "moe", "--num-layers", "2",
              "--tie-embeddings", "--dropout", "0", "--lr", "0.01", "--warmup-steps", "0", "--max-steps", "4",
              "--eval-interval", "4", "--checkpoint-interval", "4", "--ds-config", str(DS_CONFIGS / "zero2_ep.json")]
    one = _one_and_two_processes(tmp_path, embedded_cache, common)[0]

    run_cli("export", "--run", str(one), "--out", str(tmp_path / "hf"), cwd=tmp_path, cache=embedded_cache,
            check=True)
    imported = tmp_path / "imported"
    run_train([*common, "--ep-size", "2", "--max-steps", "1", "--lr", "0", "--init-from-hf", str(tmp_path / "hf"),
               "--out", str(imported)], cwd=tmp_path, cache=embedded_cache, nprocs=2)
    run_cli("export", "--run", str(imported), "--out", str(tmp_path / "hf2"), cwd=tmp_path, cache=embedded_cache,
            check=True)
    exported, again = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "hf2"))
    assert exported.keys() == again.keys() and "lm_head.weight" not in exported   # tied
    for name, tensor in exported.items():
        assert torch.equal(again[name], tensor), name


@pytest.mark.parametrize("gate", ["flat", "hierarchical"])
def test_expert_tensor_parallelism_equals_one_process_and_evaluates_whole(tmp_path, embedded_cache, gate):
    """--etp-size 2: each SwiGLU expert's hidden units over 2 ranks. 2 processes (ep 1 x etp 2, clipping active,
    ZeRO-2) and 4 (ep 2 x etp 2, ZeRO-1; the hierarchical gate: without ZeRO, clipped by train/clipping.py) take
    the steps of one process with whole experts; the 2-process run's sharded checkpoint evaluates in one process,
    as whole experts, as the one-process run does. The hierarchical gate's secondary gates are copied on the
    shards' ranks: their gradients summed over the shards, counted once in the norm."""
    common = [*TINY, "--expert-kind", "swiglu", "--noise-rng", "global", "--dropout", "0", "--lr", "0.01",
              "--warmup-steps", "0", "--max-steps", "3", "--eval-interval", "3", "--checkpoint-interval", "3",
              *(["--gate", "hierarchical", "--num-groups", "2", "--top-k", "1", "--top-k-secondary", "2"]
                if gate == "hierarchical" else [])]
    zero2, other = (str(_clip_config(tmp_path, name, clip=0.5))
                    for name in ("zero2_ep", "cpu" if gate == "hierarchical" else "zero1_ep"))
    runs = {"one": (["--ds-config", zero2], 1),
            "etp2": (["--etp-size", "2", "--ds-config", zero2], 2),
            "ep2_etp2": (["--ep-size", "2", "--etp-size", "2", "--ds-config", other], 4)}
    logs = _runs_take_the_steps_of_one(tmp_path, embedded_cache, common, runs, grad_norm=True)
    assert all(r["grad_norm"] > 0.5 for r in logs["one"])   # clipping was active on every step
    summary = json.loads((tmp_path / "etp2" / "summary.json").read_text())
    assert (summary["world_size"], summary["ep_size"], summary["etp_size"]) == (2, 1, 2)
    assert run_eval(["--run", str(tmp_path / "etp2")], cwd=tmp_path, cache=embedded_cache)["ppl"] == \
        pytest.approx(run_eval(["--run", str(tmp_path / "one")], cwd=tmp_path, cache=embedded_cache)["ppl"], rel=1e-4)
