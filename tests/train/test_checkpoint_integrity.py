"""Checkpoints are whole or not used: a file cut short, corrupted or missing is caught (by its manifest) before
resume, eval or prune-heads loads it, in one line naming the file and an older complete checkpoint; --resume-from
and --checkpoint pick that one; a save that fails or is killed leaves the previous checkpoint as the one in use."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

from moe_scale.config import RunConfig
from moe_scale.errors import UserError
from moe_scale.train import checkpoint as ckpt
from moe_scale.train.state import TrainState
from tests.cli_runs import TINY, assert_one_line_error, run_cli, run_eval, run_train, step_log

SETTINGS = [*TINY, "--num-experts", "4", "--checkpoint-interval", "3", "--eval-interval", "100"]
OLD, NEW = "step00000003", "step00000006"
STEP_9 = TrainState(seed=1234, tokens_per_step=8 * 16, max_steps=9, step=9)


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory, embedded_cache) -> Path:
    """A 6-step run with complete checkpoints after steps 3 and 6."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    run_train([*SETTINGS, "--max-steps", "6", "--out", str(run)], cwd=run.parent, cache=embedded_cache)
    return run


@pytest.fixture
def run(six_steps, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(six_steps, copy)
    return copy


def biggest_file(checkpoint: Path) -> Path:
    return max((p for p in checkpoint.rglob("*.pt")), key=lambda p: p.stat().st_size)


def test_every_complete_checkpoint_has_a_manifest_of_its_files(six_steps):
    directory = six_steps / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["complete", OLD, NEW]   # no .partial-* left
    assert json.loads((directory / "complete").read_text())["tag"] == NEW
    for tag in (OLD, NEW):
        manifest = json.loads((directory / tag / "manifest.json").read_text())
        files = {str(p.relative_to(directory / tag)) for p in (directory / tag).rglob("*") if p.is_file()}
        assert set(manifest) == files - {"manifest.json"} and manifest
        assert ckpt.problem_with(directory / tag) is None
    assert ckpt.usable_checkpoints(six_steps) == [NEW, OLD]


@pytest.mark.parametrize("damage, words", [("truncate", "cut short"), ("flip", "checksum"), ("delete", "missing")])
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_an_older_one(run, damage, words):
    victim = biggest_file(run / "checkpoints" / NEW)
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:
        victim.unlink()
    with pytest.raises(UserError) as e:
        ckpt.choose_checkpoint(run, None, "--checkpoint")
    message = str(e.value)
    assert words in message and victim.name in message and f"--checkpoint {OLD}" in message
    assert ckpt.usable_checkpoints(run) == [OLD]
    assert ckpt.choose_checkpoint(run, OLD, "--checkpoint") == (OLD, 3)


def test_resume_eval_and_prune_refuse_a_damaged_checkpoint_and_take_an_older_one(run, embedded_cache):
    victim = biggest_file(run / "checkpoints" / NEW)
    victim.write_bytes(victim.read_bytes()[:100])
    log_before = (run / "train_log.jsonl").read_text()
    proc = run_cli("train", "--resume", "--max-steps", "9", "--out", str(run), cwd=run.parent, cache=embedded_cache)
    assert_one_line_error(proc, f"checkpoint {NEW}", victim.name, "cut short", f"--resume-from {OLD}")
    assert (run / "train_log.jsonl").read_text() == log_before   # refused before anything was written
    proc = run_cli("eval", "--run", str(run), cwd=run.parent, cache=embedded_cache)
    assert_one_line_error(proc, victim.name, f"--checkpoint {OLD}")
    proc = run_cli("prune-heads", "--run", str(run), cwd=run.parent, cache=embedded_cache)
    assert_one_line_error(proc, victim.name, f"--checkpoint {OLD}")

    assert run_eval(["--run", str(run), "--checkpoint", OLD], cwd=run.parent, cache=embedded_cache)["checkpoint"] == OLD
    run_train(["--resume", "--resume-from", OLD, "--out", str(run)], cwd=run.parent, cache=embedded_cache)
    assert [r["step"] for r in step_log(run)] == [1, 2, 3, 4, 5, 6]
    assert ckpt.choose_checkpoint(run, None, "--checkpoint") == (NEW, 6)   # rewritten whole


def test_an_unreadable_marker_is_one_line(run):
    (run / "checkpoints" / "complete").write_text("{not json")
    with pytest.raises(UserError, match=f"unreadable.*--resume-from {NEW}"):
        ckpt.choose_checkpoint(run, None, "--resume-from")
    (run / "checkpoints" / "complete").unlink()
    with pytest.raises(UserError, match="no complete checkpoint"):
        ckpt.choose_checkpoint(run, None, "--resume-from")


def test_checkpoints_from_before_manifests_still_load(run, embedded_cache):
    for tag in (OLD, NEW):
        (run / "checkpoints" / tag / "manifest.json").unlink()
    assert ckpt.choose_checkpoint(run, None, "--checkpoint") == (NEW, 6)
    assert run_eval(["--run", str(run)], cwd=run.parent, cache=embedded_cache)["checkpoint"] == NEW


class _FullDisk:
    """An engine whose save writes part of a file and then finds the disk full."""

    module = None

    def save_checkpoint(self, directory, tag, **_):
        (Path(directory) / tag).mkdir(parents=True)
        (Path(directory) / tag / "mp_rank_00_model_states.pt").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")


class _Writes:
    module = None

    def save_checkpoint(self, directory, tag, **_):
        (Path(directory) / tag).mkdir(parents=True)
        (Path(directory) / tag / "mp_rank_00_model_states.pt").write_bytes(b"whole")


def test_a_failed_or_killed_save_leaves_the_previous_checkpoint_in_use(run, monkeypatch):
    monkeypatch.setattr(ckpt.dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(ckpt, "save_portable", lambda *a: None)   # the fake engines hold no model
    monkeypatch.setattr(ckpt, "_model_layout", lambda model: {"ep_size": 1, "vocab_rows": []})
    marker = (run / "checkpoints" / "complete").read_text()
    with pytest.raises(UserError, match=f"No space left on device.*previous complete checkpoint {NEW} is intact"):
        ckpt.save_checkpoint(_FullDisk(), run, STEP_9, rank=0, rows="tokens", keep=2)
    assert (run / "checkpoints" / "complete").read_text() == marker
    assert ckpt.choose_checkpoint(run, None, "--resume-from") == (NEW, 6)
    # the next save (after a resume) clears the killed one's leftovers and writes the checkpoint whole
    ckpt.save_checkpoint(_Writes(), run, STEP_9, rank=0, rows="tokens", keep=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["complete", NEW, "step00000009"]
    assert ckpt.choose_checkpoint(run, None, "--resume-from") == ("step00000009", 9)


class _TorchWriterFails:
    """An engine whose torch.save meets a full device (/dev/full), as torch's zip writer reports it."""

    module = None

    def save_checkpoint(self, directory, tag, **_):
        (Path(directory) / tag).mkdir(parents=True)
        torch.save({"w": torch.zeros(1 << 16)}, "/dev/full")


class _Bug:
    module = None

    def save_checkpoint(self, directory, tag, **_):
        raise RuntimeError("a bug, not the disk")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_inside_torch_save_is_the_same_one_line(run, monkeypatch):
    """torch's writer reports ENOSPC as RuntimeError ('unexpected pos'): with the disk nearly full that is the
    full-disk line; with space left, torch's own words; any other RuntimeError surfaces as it was."""
    monkeypatch.setattr(ckpt.dist, "barrier", lambda *a, **k: None)
    usage = shutil.disk_usage(run)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage._replace(free=3 << 20))
    with pytest.raises(UserError, match=f"writing checkpoint step00000009 to {run / 'checkpoints'} failed \\(No "
                       f"space left on device: 3 MiB free\\); the previous complete checkpoint {NEW} is intact"):
        ckpt.save_checkpoint(_TorchWriterFails(), run, STEP_9, rank=0, rows="tokens", keep=2)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage._replace(free=50 << 30))
    with pytest.raises(UserError, match="failed \\(torch could not write the file: .*unexpected pos"):
        ckpt.save_checkpoint(_TorchWriterFails(), run, STEP_9, rank=0, rows="tokens", keep=2)
    with pytest.raises(RuntimeError, match="^a bug, not the disk$"):
        ckpt.save_checkpoint(_Bug(), run, STEP_9, rank=0, rows="tokens", keep=2)
    assert ckpt.choose_checkpoint(run, None, "--resume-from") == (NEW, 6)


def test_a_full_disk_while_rank_0_writes_the_manifest_is_the_same_one_line(run, monkeypatch):
    monkeypatch.setattr(ckpt.dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(ckpt, "save_portable", lambda *a: None)
    monkeypatch.setattr(ckpt, "_model_layout", lambda model: {"ep_size": 1, "vocab_rows": []})

    def full(path, value):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "write_json_atomic", full)
    with pytest.raises(UserError, match=f"No space left on device: \\d+ MiB free\\); the previous complete checkpoint "
                       f"{NEW} is intact; free space on that file system, then continue with --resume"):
        ckpt.save_checkpoint(_Writes(), run, STEP_9, rank=0, rows="tokens", keep=2)
    assert ckpt.choose_checkpoint(run, None, "--resume-from") == (NEW, 6)


def test_a_checkpoint_from_before_rows_were_cut_by_tokens_resumes_with_a_warning(run, embedded_cache):
    layout = json.loads((run / "checkpoints" / NEW / "layout.json").read_text())
    assert layout["rows"] == "tokens"
    same = run.parent / "same"
    shutil.copytree(run, same)
    proc = run_train(["--resume", "--max-steps", "7", "--out", str(same)], cwd=run.parent, cache=embedded_cache)
    assert "warning" not in proc.stderr
    del layout["rows"]   # as written before 2026-11-26, when rows were cut after equal numbers of lines
    (run / "checkpoints" / NEW / "layout.json").write_text(json.dumps(layout))
    manifest = json.loads((run / "checkpoints" / NEW / "manifest.json").read_text())
    del manifest["layout.json"]
    (run / "checkpoints" / NEW / "manifest.json").write_text(json.dumps(manifest))
    proc = run_train(["--resume", "--max-steps", "7", "--out", str(run)], cwd=run.parent, cache=embedded_cache)
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and f"checkpoint {NEW} was trained on rows cut by lines" in warnings[0]
    assert "from step 6 on the run reads the text in another order" in warnings[0]
    assert [r["loss"] for r in step_log(run)] == [r["loss"] for r in step_log(same)]   # the same data here


class _DoesNotFit:
    module = None

    def load_checkpoint(self, *a, **k):
        raise RuntimeError("loaded state dict contains a parameter group that doesn't match the size of optimizer's "
                           "group")


def test_a_hierarchical_checkpoint_from_before_sharded_secondary_gates_is_named_as_such(tmp_path):
    """Before 2026-11-26 the hierarchical gate's secondary matrices were whole in the non-expert file; such a
    checkpoint no longer resumes (its optimizer groups differ), and the line says why instead of blaming an edit."""
    old = tmp_path / "run" / "checkpoints" / "step00000004"
    old.mkdir(parents=True)
    torch.save({"module": {"moe.router.w_gate_primary": torch.zeros(32, 4),
                           "moe.router.w_gate_secondary": torch.zeros(4, 32, 4)}}, old / "mp_rank_00_model_states.pt")
    with pytest.raises(UserError, match="^checkpoint step00000004 was written before the hierarchical gate's "
                       "secondary matrices were stored with their experts .*training cannot resume from it"):
        ckpt.load_weights(_DoesNotFit(), tmp_path / "run", "step00000004")
    torch.save({"module": {"moe.router.w_gate": torch.zeros(32, 4)}}, old / "mp_rank_00_model_states.pt")
    with pytest.raises(UserError, match="^checkpoint step00000004 does not fit this model .*doesn't match"):
        ckpt.load_weights(_DoesNotFit(), tmp_path / "run", "step00000004")
    (old / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="does not fit this model"):
        ckpt.load_weights(_DoesNotFit(), tmp_path / "run", "step00000004")


def _edit_config(run: Path, section: str, key: str, value) -> None:
    config = json.loads((run / "config.json").read_text())
    config[section][key] = value
    (run / "config.json").write_text(json.dumps(config))


def test_a_config_edited_after_the_checkpoint_is_refused_naming_the_setting(run, embedded_cache):
    assert json.loads((run / "checkpoints" / NEW / "config.json").read_text()) == \
        json.loads((run / "config.json").read_text())   # each checkpoint keeps the config it was trained with
    _edit_config(run, "model", "d_model", 48)
    for args in (["train", "--resume", "--out", str(run)], ["eval", "--run", str(run)]):
        proc = run_cli(*args, cwd=run.parent, cache=embedded_cache)
        assert_one_line_error(proc, f"checkpoint {NEW} was trained with --d-model 32", "says 48",
                              str(run / "checkpoints" / NEW / "config.json"))


def test_a_checkpoint_that_does_not_fit_the_model_is_one_line_even_without_its_config(run, embedded_cache):
    for tag in (OLD, NEW):   # as written before checkpoints kept their config
        (run / "checkpoints" / tag / "config.json").unlink()
        manifest = json.loads((run / "checkpoints" / tag / "manifest.json").read_text())
        del manifest["config.json"]
        (run / "checkpoints" / tag / "manifest.json").write_text(json.dumps(manifest))
    _edit_config(run, "model", "d_model", 48)
    proc = run_cli("eval", "--run", str(run), cwd=run.parent, cache=embedded_cache)
    assert_one_line_error(proc, f"checkpoint {NEW} does not fit this model", "size mismatch", "config.json")


def test_another_layout_needs_the_portable_state_and_no_stream(run):
    config = RunConfig.load(run / "config.json")
    assert ckpt.choose_checkpoint(run, None, "--resume-from", config, resume_world=2) == (NEW, 6)   # reshards
    config.data.stream = True
    with pytest.raises(UserError, match=f"{NEW} was written by 1 process with --ep-size 1: a --stream run resumes "
                                        f"only with the same layout"):
        ckpt.choose_checkpoint(run, None, "--resume-from", config, resume_world=2)
    config.data.stream = False
    shutil.rmtree(run / "checkpoints" / NEW / "portable")
    manifest = json.loads((run / "checkpoints" / NEW / "manifest.json").read_text())
    (run / "checkpoints" / NEW / "manifest.json").write_text(json.dumps(
        {name: entry for name, entry in manifest.items() if not name.startswith("portable")}))
    with pytest.raises(UserError, match="before checkpoints carried a portable copy of the state; resume it with "
                                        "that layout"):
        ckpt.choose_checkpoint(run, None, "--resume-from", config, resume_world=2)
    assert ckpt.choose_checkpoint(run, None, "--resume-from", config, resume_world=1) == (NEW, 6)
