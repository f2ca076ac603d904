"""tools/capacity_sweep.py: a computationally matched model table (ops/timestep within 5% of the dense baseline,
parameters as the meta-device models count them), refusals, a two-point sweep end to end, and a killed sweep
that resumes (the finished point kept, the interrupted one continued from its checkpoint)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_scale.accounting.flops import lstm_layer_shape
from moe_scale.models.meta_build import build_lstm_lm_on_meta, parameters_per_child
from moe_scale.config import RunConfig
from tests.wikitext import wikitext_sentences
from tests.cli_runs import cli_env
from tests.paths import TOOLS

TOOL = TOOLS / "capacity_sweep.py"


@pytest.fixture(scope="module")
def sweep_module(load_tool):
    return load_tool("capacity_sweep")


@pytest.mark.parametrize("d, ffn", [(128, 1024), (64, 512)])
def test_model_table_is_computationally_matched(sweep_module, d, ffn):
    names = sweep_module.ALL
    table = sweep_module.model_table(names, d, ffn, 10000, 0.05)
    assert [m.name for m in table] == names
    target = table[0].ops
    for model in table:
        assert abs(model.ops - target) <= 0.05 * target, model.name
        config = RunConfig.from_settings(**model.settings)
        counts = parameters_per_child(build_lstm_lm_on_meta(config, 10000))
        module = sum(counts.values()) - counts["embedding"] - counts["softmax"]
        units, _ = lstm_layer_shape(config)
        lstms = {"lstm-ffn-lstm": 2, "lstm-moe-lstm": 2, "4xlstm": 4}[config.model.lstm.layout]
        assert module - model.params == lstms * 4 * units, model.name   # torch's second LSTM bias vector
        if model.experts:
            assert config.moe.experts.num_experts == model.experts and config.moe.experts.hidden >= 8
    by_name = {m.name: m for m in table}
    assert by_name["moe-4096-h"].params > by_name["moe-256-h"].params > by_name["moe-32"].params > \
        by_name["dense"].params   # capacity grows at equal compute


def test_refuses_a_model_it_cannot_match(tmp_path, wikitext_dir):
    proc = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path / "o"), "--data",
                           str(wikitext_dir / "valid.txt"), "--test-data", str(wikitext_dir / "test.txt"),
                           "--d-model", "64", "--ffn-hidden", "256", "--models", "moe-256"],
                          capture_output=True, text=True, env=cli_env(), timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "moe-256: its gate leaves" in proc.stderr and "--ffn-hidden" in proc.stderr
    assert not (tmp_path / "o").exists()


def _corpus(root: Path) -> Path:
    root.mkdir()
    for name, lines in (("train.txt", wikitext_sentences("valid")[:1700]),
                        ("test.txt", wikitext_sentences("test")[:200])):
        (root / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def _sweep(data: Path, out: Path, steps: int, *flags: str) -> list[str]:
    return [sys.executable, str(TOOL), "--out", str(out), "--data", str(data / "train.txt"), "--test-data",
            str(data / "test.txt"), "--models", "dense,moe-32",
            "--seeds", "1", "--d-model", "32", "--ffn-hidden", "256", "--vocab-size", "500", "--batch-size", "8",
            "--seq-len", "16", "--max-steps", str(steps), "--checkpoint-interval", "20", *flags,
            "--extra", "--eval-max-batches", "4"]


# Size: 160 steps, so that moe-32 is still training (140 steps to go) when its first checkpoint (step 20) appears and
# the kill lands mid-run even on a loaded machine; the resumed sweep then trains the rest. Two models: the fewest a
# table compares.
STEPS = 160
@pytest.mark.slow
def test_two_point_sweep_writes_its_report_and_a_killed_sweep_resumes(tmp_path, embedded_cache):
    data, out = _corpus(tmp_path / "text"), tmp_path / "sweep"
    env = cli_env(embedded_cache)
    proc = subprocess.Popen(_sweep(data, out, STEPS), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    marker = out / "runs" / "moe-32-s1" / "checkpoints" / "complete"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)   # the tool and its `moe-scale train`, mid-run
    proc.wait()
    assert (out / "runs" / "dense-s1" / "summary.json").is_file()
    assert not (out / "runs" / "moe-32-s1" / "summary.json").exists(), "the run ended before it could be killed"
    finished = (out / "runs" / "dense-s1" / "train_log.jsonl").read_bytes()
    assert not (out / "runs" / "dense-s1" / "checkpoints").exists()   # scored, so its checkpoints went

    # started again (keeping checkpoints this time, which changes no result)
    again = subprocess.run(_sweep(data, out, STEPS, "--keep-checkpoints"), env=env, capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "runs" / "dense-s1" / "train_log.jsonl").read_bytes() == finished   # kept, not run again
    steps = [json.loads(line)["step"] for line in (out / "runs" / "moe-32-s1" / "train_log.jsonl").read_text()
             .splitlines()]
    assert steps == list(range(1, STEPS + 1))   # continued from its checkpoint: every step logged once

    for name in ("capacity.json", "capacity.md", "capacity_ppl.png", "capacity_speed.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    report = json.loads((out / "capacity.json").read_text())
    rows = {r["model"]: r for r in report["rows"]}
    assert set(rows) == {"dense", "moe-32"} and rows["dense"]["speed_vs_dense"] == 1.0
    for row in rows.values():
        seed = row["seeds"]["1"]
        assert (out / seed["run"] / "summary.json").is_file()
        assert seed["test_ppl"] > 1 and seed["tokens_per_s"] > 0
    kept = [tag.name for tag in (out / "runs" / "moe-32-s1" / "checkpoints").glob("step*")]
    assert kept == [json.loads((out / "runs" / "moe-32-s1" / "checkpoints" / "complete").read_text())["tag"]]
    assert not (out / "runs" / "dense-s1" / "checkpoints").exists()
    assert rows["moe-32"]["params_excluding_embedding_softmax"] > rows["dense"]["params_excluding_embedding_softmax"]
    assert "[s1](runs/moe-32-s1)" in (out / "capacity.md").read_text()
