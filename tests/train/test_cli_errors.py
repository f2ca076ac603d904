"""Bad input ends in one clear line on stderr, exit status 2, no traceback, and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FAST = ["--max-steps", "1", "--batch-size", "4", "--seq-len", "8", "--eval-max-batches", "1"]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_scale.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("moe-scale: error:")]
    assert len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat .\n" * 400)
    return path


def test_missing_data_path(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--data", str(tmp_path / "nope.txt"), "--out", str(out), *FAST, cwd=tmp_path)
    assert_one_line_error(proc, "--data", "nope.txt")
    assert not out.exists()


def test_empty_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n   \n")
    out = tmp_path / "run"
    proc = run_cli("train", "--data", str(corpus), "--out", str(out), *FAST, cwd=tmp_path)
    assert_one_line_error(proc, "empty")
    assert not out.exists()


def test_top_k_larger_than_experts(tmp_path, text_file):
    out = tmp_path / "run"
    proc = run_cli("train", "--data", str(text_file), "--num-experts", "4", "--top-k", "5", "--out", str(out),
                   *FAST, cwd=tmp_path)
    assert_one_line_error(proc, "--top-k 5", "--num-experts 4")
    assert not out.exists()


def test_zero3_with_moe_is_refused(tmp_path, text_file):
    ds = tmp_path / "z3.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    out = tmp_path / "run"
    proc = run_cli("train", "--data", str(text_file), "--ds-config", str(ds), "--out", str(out), *FAST,
                   cwd=tmp_path)
    assert_one_line_error(proc, "stage 3", "stage 2")
    assert not out.exists()


@pytest.mark.parametrize("content, fragment", [
    ('{"gradient_clipping": 1.0,', "not valid JSON"),
    ('{"zero_optimisation": {"stage": 2}}', "did you mean 'zero_optimization'"),
    ('{"optimizer": {"type": "Adam"}}', "remove 'optimizer'"),
    ('[1, 2]', "JSON object"),
    ('{"train_batch_size": 7}', "train_batch_size"),
    # nested keys and values, checked against DeepSpeed's own schema before the engine starts
    ('{"zero_optimization": {"stage": 2, "overlap_comm": "maybe"}}', "'zero_optimization.overlap_comm'"),
    ('{"zero_optimization": {"stagee": 2}}', "'zero_optimization.stagee'"),
    ('{"zero_optimization": {"stage": true}}', "stage must be 0, 1 or 2"),
    ('{"gradient_clipping": "abc"}', "gradient_clipping must be a number"),
    ('{"fp16": {"enabled": true}}', "fp16 needs a GPU"),
])
def test_bad_ds_config(tmp_path, text_file, content, fragment):
    ds = tmp_path / "ds.json"
    ds.write_text(content)
    out = tmp_path / "run"
    proc = run_cli("train", "--data", str(text_file), "--ds-config", str(ds), "--out", str(out), *FAST,
                   cwd=tmp_path)
    assert_one_line_error(proc, fragment)
    assert not out.exists()


@pytest.mark.parametrize("content, fragment", [
    ('{"model": {"num_expert": 4}}', "unknown key(s) ['num_expert']"),
    ('{"modle": {}}', "unknown section(s) ['modle']"),
    ('{"model": ', "not valid JSON"),
])
def test_bad_run_config(tmp_path, content, fragment):
    config = tmp_path / "config.json"
    config.write_text(content)
    out = tmp_path / "run"
    proc = run_cli("train", "--config", str(config), "--out", str(out), *FAST, cwd=tmp_path)
    assert_one_line_error(proc, fragment)
    assert not out.exists()


def test_unwritable_out(tmp_path, text_file):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = run_cli("train", "--data", str(text_file), "--out", str(blocker / "run"), *FAST, cwd=tmp_path)
    assert_one_line_error(proc, "--out", "a_file")
    proc = run_cli("train", "--data", str(text_file), "--out", "/proc/moe_scale_run", *FAST, cwd=tmp_path)
    assert_one_line_error(proc, "--out")


def test_data_too_small_for_batch(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a b c .\n" * 3)
    out = tmp_path / "run"
    proc = run_cli("train", "--data", str(tiny), "--valid-data", str(tiny), "--test-data", str(tiny),
                   "--out", str(out), "--batch-size", "64", "--seq-len", "32", "--max-steps", "1", cwd=tmp_path)
    assert_one_line_error(proc, "--batch-size")
    assert not out.exists()


def test_eval_without_a_run(tmp_path):
    proc = run_cli("eval", "--run", str(tmp_path / "missing"), cwd=tmp_path)
    assert_one_line_error(proc, "--run")


@pytest.mark.parametrize("flags,fragment", [
    (["--dispatch", "capacity", "--capacity-factor", "0"], "--capacity-factor must be positive"),
    (["--dispatch", "capacity", "--capacity-factor", "-1"], "--capacity-factor must be positive"),
    (["--node-size", "-2"], "--node-size"),
    (["--num-experts", "6", "--ep-size", "4"], "not divisible by --ep-size"),
    (["--ep-size", "2"], "does not divide the 1 processes"),
    (["--model", "transformer", "--attention", "mae", "--stream"], "--mae-g-unit epoch needs epochs"),
    (["--checkpoint-interval", "-1"], "--checkpoint-interval must be 0 (never) or positive"),
])
def test_bad_dispatch_and_parallel_settings(tmp_path, text_file, flags, fragment):
    out = tmp_path / "run"
    proc = run_cli("train", "--data", str(text_file), "--out", str(out), *FAST, *flags, cwd=tmp_path)
    assert_one_line_error(proc, fragment)
    assert not out.exists()


def test_hierarchical_node_layout_is_checked(monkeypatch):
    from moe_scale.errors import UserError
    from moe_scale.train.loop import _check_node_layout

    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match="pass --node-size"):
        _check_node_layout(4, 0)
    with pytest.raises(UserError, match="must divide one another"):
        _check_node_layout(4, 3)
    _check_node_layout(4, 2), _check_node_layout(2, 8)          # whole nodes / inside one node: fine
    monkeypatch.setenv("LOCAL_SIZE", "3")                      # the deepspeed launcher's variable
    with pytest.raises(UserError, match="3 ranks per node"):
        _check_node_layout(4, 0)
