"""`moe-scale plan` in process, on the issue's tiny LSTM-MoE (d 64, 32 timesteps, 16 experts, 2,000 words, 32
sequences a step): --tokens' wall time and GPU-hours, times in readable units, --config's expert-parallel default,
the remark where more nodes are slower, and the search's refusal reasons."""

from __future__ import annotations

import json
import math

import pytest

from moe_scale.accounting.plan import training
from moe_scale.accounting.units import duration_text, parse_count, seconds_text
from moe_scale.cli import build_parser
from moe_scale.commands.plan import run_plan
from moe_scale.config import RunConfig
from moe_scale.errors import UserError

TINY = ["--num-experts", "16", "--d-model", "64", "--expert-hidden", "256", "--top-k", "2", "--vocab-size", "2000",
        "--seq-len", "32", "--batch-size", "32", "--gpu", "h100-sxm"]


def plan(*args: str) -> str:
    return run_plan(build_parser().parse_args(["plan", *args]))


def plan_json(*args: str) -> dict:
    return json.loads(plan(*args, "--json"))


@pytest.mark.parametrize("seconds,text", [(1.5, "1.5 s"), (0.012345, "12.35 ms"), (4.2e-5, "42 µs"), (0.0, "0 s"),
                                          (3e-9, "3 ns"), (2.195e-3, "2.195 ms"), (12345.0, "12,345 s")])
def test_times_in_the_unit_that_shows_them(seconds, text):
    assert seconds_text(seconds) == text


@pytest.mark.parametrize("seconds,text", [(90.0, "90 s"), (150.0, "2.5 min"), (4000.0, "66.7 min"),
                                          (7200.0, "2 h"), (3 * 86400.0, "3 days")])
def test_wall_times(seconds, text):
    assert duration_text(seconds) == text


@pytest.mark.parametrize("text,count", [("1B", 10 ** 9), ("100M", 10 ** 8), ("1.5k", 1500), ("2e9", 2 * 10 ** 9),
                                        ("2T", 2 * 10 ** 12), ("1_000_000", 10 ** 6), ("7G", 7 * 10 ** 9)])
def test_token_counts(text, count):
    assert parse_count(text, "--tokens") == count


@pytest.mark.parametrize("text", ["0", "-5", "x", "1Q", "M", "nan", "inf"])
def test_bad_token_counts_are_one_line(text):
    with pytest.raises(UserError, match=f"--tokens {text}: give a positive count of tokens"):
        parse_count(text, "--tokens")


def test_training_time_by_hand():
    """1B tokens at 250,000 tokens/s on 16 GPUs, 1,024 tokens a step: 4,000 s, 4,000 x 16 / 3,600 GPU-hours."""
    t = training({"tokens_per_s": 250_000.0, "tokens_per_step": 1024, "world": 16}, 10 ** 9)
    assert t == {"tokens": 10 ** 9, "steps": 976_563, "wall_s": 4000.0, "gpu_hours": pytest.approx(17.777, abs=1e-3)}


def test_tokens_readable_times_and_the_many_nodes_remark():
    """2 nodes of H100s: --tokens from the plan's own tokens/s, in the text and the JSON; no step part printed as
    zero; 2 nodes predict fewer tokens/s than 1 (the exchanges), with the reason in one line."""
    result = plan_json(*TINY, "--nodes", "2", "--tokens", "1B")
    t = result["training"]
    assert t["wall_s"] == pytest.approx(1e9 / result["tokens_per_s"])
    assert t["gpu_hours"] == pytest.approx(1e9 / result["tokens_per_s"] * 16 / 3600)
    assert t["steps"] == math.ceil(1e9 / 1024) and result["world"] == 16
    remark = result["fewer_nodes"]
    assert remark["fewer_nodes"] == 1 and remark["slowdown"] > 1 and result["remarks"] == [remark["text"]]
    assert "exchanges and all-reduces take" in remark["text"] and "vocabulary rows" in remark["text"]
    text = plan(*TINY, "--nodes", "2", "--tokens", "1B")
    assert f"  1B tokens: {duration_text(t['wall_s'])} on 16 GPUs" in text
    step_lines = text.split("  step time\n")[1].split("\n  ")[0]
    assert "0.0000" not in text and " ms" in step_lines and "µs" in step_lines
    assert "  warning: the compute is the launch floor" in text and "  remark: 2 nodes predict" in text


def test_the_remark_gives_the_batch_at_which_more_nodes_pay():
    """With the vocabulary tables whole, 2 nodes beat 1 at a large enough batch: the hint's growth, checked by
    planning both at that batch."""
    result = plan_json(*TINY, "--nodes", "2", "--vocab-exchange", "dense")
    growth, batch = result["fewer_nodes"]["batch_growth"], result["fewer_nodes"]["batch_tokens"]
    assert growth and batch == growth * 1024 and f"grow the global batch {growth:,}x" in result["remarks"][0]
    two, one = (plan_json(*TINY, "--nodes", n, "--vocab-exchange", "dense", "--batch-tokens", str(batch))
                for n in ("2", "1"))
    assert two["tokens_per_s"] > one["tokens_per_s"]
    half = plan_json(*TINY, "--nodes", "2", "--vocab-exchange", "dense", "--batch-tokens", str(batch // 2))
    assert half["remarks"]          # at half that batch 2 nodes are still the slower


def test_config_takes_the_documented_expert_parallel_default(tmp_path):
    """A run trained with --ep-size 1 (a CPU run): plan --config uses the largest ep dividing the GPUs and the
    experts, and says so; --ep-size given again keeps it."""
    config = RunConfig.from_settings(num_experts=16, d_model=64, expert_hidden=256, vocab_size=2000, ep_size=1)
    config.save(tmp_path / "config.json")
    result = plan_json("--config", str(tmp_path), "--gpu", "h100-sxm", "--nodes", "2")
    assert result["ep_size"] == 16
    assert result["ep_size_reason"] == ("ep 16: the default, the largest that divides the 16 GPUs and the 16 experts; "
                                        "--config's run had --ep-size 1: pass --ep-size 1 to plan that")
    kept = plan_json("--config", str(tmp_path), "--gpu", "h100-sxm", "--nodes", "2", "--ep-size", "1")
    assert kept["ep_size"] == 1 and kept["ep_size_reason"] == "ep 1: --ep-size given"
    assert "\n  ep 16: the default" in plan("--config", str(tmp_path), "--gpu", "h100-sxm", "--nodes", "2")


def test_search_says_why_it_refuses_and_what_does_not_fit():
    text = plan(*TINY, "--nodes", "1,2", "--search", "--top", "2", "--gpu-mem", "2.4", "--tokens", "100M")
    refused = [line for line in text.splitlines() if line.startswith("  refused by train")]
    zero = "under which --optimizer factored cannot factor the expert matrices: DeepSpeed then flattens parameters " \
        "into 1-D partitions"
    assert refused and all(zero in line for line in refused)
    too_large = [line for line in text.splitlines() if line.startswith("  too large (")]
    assert len(too_large) == 1 and "does not fit, the least of them needs 2.30 GiB per GPU > 2.28 GiB usable" \
        in too_large[0]
    assert "100M tokens" in text.split("layouts that fit")[1]
