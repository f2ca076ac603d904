"""`moe-scale plan` as a user runs it: train's model flags, --json keys (a superset of the memory planner's), the
text report, --search, --plot, and bad input in one line."""

from __future__ import annotations

import json

import pytest

from tests.cli_runs import assert_one_line_error, run_cli
from tests.paths import DS_CONFIGS

# The keys `plan --preset ... --json` printed before it predicted time (they must stay).
MEMORY_PLANNER_KEYS = {"preset", "nodes", "gpus_per_node", "world", "ep_size", "experts_per_gpu", "zero_stage",
                       "optimizer", "precision", "tokens_per_gpu", "params_per_gpu", "bytes", "gpu_mem_bytes", "fits",
                       "smallest_fitting"}
MEMORY_PLANNER_BYTES = {"parameters", "gradients", "optimizer_state", "activations", "total"}
CUSTOM = ["--num-experts", "16", "--d-model", "64", "--expert-hidden", "256", "--vocab-size", "2000"]


def _not_json(constant: str):
    raise AssertionError(f"--json printed {constant}, which strict JSON parsers refuse")


def plan(tmp_path, *args: str):
    return run_cli("plan", *args, cwd=tmp_path)


def test_preset_json_keeps_its_keys(tmp_path):
    proc = plan(tmp_path, "--preset", "lm1b-moe-4096-h", "--nodes", "2", "--gpus-per-node", "8", "--zero", "2",
                "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout, parse_constant=_not_json)   # strict JSON: no Infinity, no NaN
    assert MEMORY_PLANNER_KEYS <= set(result) and MEMORY_PLANNER_BYTES <= set(result["bytes"])
    assert set(result["smallest_fitting"]) == {"nodes", "world", "total_bytes"}
    assert (result["nodes"], result["world"], result["ep_size"], result["zero_stage"]) == (2, 16, 16, 2)
    assert result["tokens_per_step"] == 9376 * 32     # the paper's 300,000 words, whole sequences on 16 GPUs
    assert {"time", "tokens_per_s", "tflops_per_gpu", "mfu"} <= set(result)


def test_custom_model_text_search_and_plot(tmp_path):
    proc = plan(tmp_path, *CUSTOM, "--gpu", "a100-80", "--ds-config", str(DS_CONFIGS / "zero2_ep.json"), "--nodes",
                "1,2", "--search", "--top", "3", "--plot", "plan.png")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "custom on 1 node(s) x 8 a100-80" in out and "ZeRO-2" in out and "tokens/s" in out
    assert "layouts that fit, by predicted tokens/s (3 shown" in out
    assert "refused by train" in out and "has ZeRO stage" in out       # factored under ZeRO-1/2
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_auto_nodes_is_the_smallest_that_fits(tmp_path):
    proc = plan(tmp_path, "--preset", "news100b-moe-65536-h", "--gpu", "k40", "--optimizer", "factored", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout, parse_constant=_not_json)
    assert result["fits"] and result["world"] == result["smallest_fitting"]["world"] == 128


@pytest.mark.parametrize("args,fragments", [
    (["--gpu", "x100"], ["--gpu x100: unknown GPU", "k40, v100, a100-40", "l40s"]),
    (["--nodes", "0"], ["--nodes 0: give a node count from 1"]),
    (["--nodes", "two"], ["--nodes two: give a node count"]),
    (["--nodes", "1,2"], ["a list of node counts is for --search or --plot"]),
    (["--gpus-per-node", "0"], ["--gpus-per-node 0: must be at least 1"]),
    (["--margin", "1.5"], ["--margin 1.5: must be in [0, 1)"]),
    (["--efficiency", "0"], ["--efficiency 0.0: must be in (0, 1]"]),
    (["--inter-node-gbs", "-1"], ["--inter-node-gbs -1.0: must be a positive finite bandwidth"]),
    (["--inter-node-gbs", "inf"], ["--inter-node-gbs inf: must be a positive finite bandwidth"]),
    (["--gpu-mem", "inf"], ["--gpu-mem inf: must be a positive finite size"]),
    (["--gpu-mem", "nan"], ["--gpu-mem nan: must be a positive finite size"]),
    (["--dropless-load", "0.5"], ["--dropless-load 0.5: must be at least 1"]),
    (["--zero", "3"], ["ZeRO stage 3 cannot shard MoE layers"]),
    (["--zero", "2", "--optimizer", "factored", "--nodes", "1"], ["--zero 2", "has ZeRO stage 2",
                                                                   "--optimizer factored cannot factor"]),
    (["--gpu", "k40", "--precision", "bf16"], ["--precision bf16: the k40 has no bf16 units"]),
    (["--nodes", "3", "--ep-size", "16", "--num-experts", "16"], ["--ep-size 16 does not divide the 24 processes"]),
    (["--num-experts", "12", "--ep-size", "8", "--nodes", "1"], ["--num-experts 12 is not divisible by --ep-size 8"]),
    (["--plot", "missing/plan.png"], ["--plot missing/plan.png: give a file in an existing directory"]),
    (["--plot", "/proc/plan.png"], ["--plot /proc/plan.png: not written", "give a file where you may write"]),
    (["--resume"], ["plan takes no --resume"]),
    (["--out", "runs/x"], ["unrecognized arguments: --out runs/x"]),          # plan makes no run directory
    (["--preset", "nope"], ["--preset nope: unknown preset"]),
    (["--top", "0", "--search"], ["--top 0: must be at least 1"]),
])
def test_bad_input_is_one_line(tmp_path, args, fragments):
    assert_one_line_error(plan(tmp_path, *args), *fragments)
    assert not any(tmp_path.iterdir())


def test_help_lists_the_model_flags_and_none_of_a_run_directorys(tmp_path):
    proc = plan(tmp_path, "--help")
    assert proc.returncode == 0 and "--num-experts" in proc.stdout and "--gpus-per-node" in proc.stdout
    for flag in ("--out", "--overwrite", "--resume", "--log-interval", "--keep-checkpoints", "--accept-changed-data"):
        assert f"  {flag}" not in proc.stdout, flag
