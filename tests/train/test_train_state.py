"""The training loop's state (train/state.py) and the interface its data sources declare (data/source.py): the
state round-trips through a checkpoint in the format every checkpoint so far has (the step as DeepSpeed's client
state, a streamed source's position in data_stream_rank<r>.pt), so one written before the state existed resumes
as before; every source the loop trains on is a TrainingSource; a run leaves the config it was given as it was."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from moe_scale.config import DataConfig, RunConfig
from moe_scale.data.source import TrainingSource
from moe_scale.distributed.launch import DistEnv
from moe_scale.errors import UserError
from moe_scale.train import checkpoint as ckpt
from moe_scale.train.data_setup import build_lm_data
from moe_scale.train.state import TrainState
from tests.cli_runs import TINY, assert_one_line_error, run_cli, step_log

ONE_PROCESS = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
TAG = "step00000005"


def _data(root: Path) -> Path:
    """60 short sentences of training text (2 steps of TINY's 8 x 16 tokens) and a validation file."""
    data = root / "data"
    data.mkdir(parents=True)
    (data / "train.txt").write_text("".join(f"w{i % 13} w{i % 7} w{i % 5} .\n" for i in range(60)))
    (data / "valid.txt").write_text("w1 w2 w3 .\n" * 20)
    return data


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MOE_SCALE_CACHE", str(tmp_path / "cache"))   # the streamed vocabulary's cache
    return _data(tmp_path)


def _sources(data: Path) -> dict:
    """{stream: the training source build_lm_data makes of `data`}, in memory and streamed."""
    return {stream: build_lm_data(DataConfig(data=str(data), seq_len=4, stream=stream, shuffle_buffer=8),
                                  ONE_PROCESS, global_rows=2, saved_run=None, seed=3).train
            for stream in (False, True)}


def test_every_training_source_declares_the_interface(data):
    sources = _sources(data)
    in_memory, streamed = sources[False], sources[True]
    for source in sources.values():
        assert isinstance(source, TrainingSource)
        assert source.last_step is None and source.describe()
    # in memory: epochs, rows cut by tokens, the position a function of the step
    assert in_memory.steps_per_epoch == in_memory.num_windows and in_memory.row_layout == "tokens"
    assert in_memory.state_dict() is None
    in_memory.load_state_dict(None)
    # streamed: one pass, a position of its own
    assert streamed.steps_per_epoch is None and streamed.row_layout is None
    assert streamed.state_dict()["step"] == 0
    assert not isinstance(object(), TrainingSource)


class _Engine:
    """DeepSpeed's checkpoint calls as far as the training state goes: the client state in a file of its own."""

    def __init__(self):
        self.module = torch.nn.Linear(1, 1)   # no expert-parallel module: --ep-size 1
        self.saved: list[dict] = []

    def save_checkpoint(self, directory, tag, client_state, save_latest):
        (Path(directory) / tag).mkdir(parents=True)
        torch.save(client_state, Path(directory) / tag / "mp_rank_00_model_states.pt")
        self.saved.append(client_state)

    def load_checkpoint(self, directory, tag, **_):
        return directory, torch.load(Path(directory) / tag / "mp_rank_00_model_states.pt")


@pytest.fixture
def one_process_saves(monkeypatch):
    monkeypatch.setattr(ckpt.dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(ckpt, "save_portable", lambda *a: None)   # the fake engine holds no model


def _planned(source) -> TrainState:
    return TrainState.planned(RunConfig.from_settings(batch_size=2, seq_len=4, max_steps=9), source.state_dict())


def _trained(source, steps: int) -> TrainState:
    state = _planned(source)
    for step in range(steps):
        source.batch(step, shuffle_seed=state.seed)
        state.step_done(source.state_dict())
    return state


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_the_state_round_trips_through_a_checkpoint(tmp_path, data, one_process_saves, stream):
    source = _sources(data)[stream]
    state, engine = _trained(source, 5), _Engine()
    ckpt.save_checkpoint(engine, tmp_path / "run", state, 0, rows=source.row_layout, keep=2)
    assert engine.saved == [{"step": 5}]                 # DeepSpeed's client state: as in every checkpoint so far
    checkpoint = tmp_path / "run" / "checkpoints" / TAG
    assert (checkpoint / "data_stream_rank0.pt").is_file() == stream
    assert json.loads((checkpoint / "layout.json").read_text()).get("rows") == source.row_layout

    fresh = _sources(data)[stream]   # as a new process builds it
    resumed = _planned(fresh)
    ckpt.load_checkpoint(engine, tmp_path / "run", TAG, resumed, fresh)
    assert (resumed.step, resumed.start_step, resumed.max_steps) == (5, 5, 9)
    assert repr(resumed.data_position) == repr(state.data_position)
    for step in range(5, 7):
        assert all(torch.equal(a, b) for a, b in zip(fresh.batch(step, 1234), source.batch(step, 1234)))


def test_a_streamed_checkpoint_written_before_the_state_existed_resumes(tmp_path, data, one_process_saves):
    """Written file by file as moe_scale wrote them before train/state.py: the client state {"step": 5}, and the
    stream's own state_dict() beside it."""
    source = _sources(data)[True]
    for step in range(5):
        source.batch(step)
    checkpoint = tmp_path / "run" / "checkpoints" / TAG
    checkpoint.mkdir(parents=True)
    torch.save({"step": 5}, checkpoint / "mp_rank_00_model_states.pt")
    torch.save(source.state_dict(), checkpoint / "data_stream_rank0.pt")
    (checkpoint / "layout.json").write_text(json.dumps({"world_size": 1, "ep_size": 1}))

    fresh = _sources(data)[True]
    state = _planned(fresh)
    ckpt.load_checkpoint(_Engine(), tmp_path / "run", TAG, state, fresh)
    assert state.step == 5 and state.data_position["step"] == 5
    assert torch.equal(fresh.batch(5)[0], source.batch(5)[0])
    (checkpoint / "data_stream_rank0.pt").unlink()
    with pytest.raises(UserError, match="data_stream_rank0.pt is missing: checkpoint step00000005 was not "
                                             "written by a streamed run"):
        ckpt.load_checkpoint(_Engine(), tmp_path / "run", TAG, _planned(fresh), fresh)


def train_reporting_the_config(argv: list[str]) -> int:
    """`moe-scale ARGV` in a process of its own (tests/forked.py), saying whether run_training left its config
    as it was given."""
    import moe_scale.train.loop as loop
    from moe_scale.cli import main

    real_run_training = loop.run_training

    def run_training(config):
        given = copy.deepcopy(config)
        summary = real_run_training(config)
        print(f"config unchanged: {config == given}")
        return summary

    loop.run_training = run_training
    return main(argv)


@pytest.mark.slow   # over 5 s on 2 cores (tests/README.md)
def test_a_run_leaves_its_config_as_given_and_its_checkpoints_in_their_format(tmp_path):
    """--token-budget sets the number of steps, the data ending first shortens it, and a resume of the finished
    pass is refused: the state's schedule, never the config's max_steps (config.json records the planned one)."""
    run = tmp_path / "run"
    args = ["train", *TINY, "--data", str(_data(tmp_path)), "--stream", "--token-budget", "100000",
            "--eval-interval", "100", "--checkpoint-interval", "100", "--out", str(run)]
    proc = run_cli(*args, cwd=tmp_path, cache=tmp_path / "cache", entry=train_reporting_the_config, check=True)
    assert "config unchanged: True" in proc.stdout
    config = (run / "config.json").read_bytes()
    assert_one_line_error(run_cli(*args, "--resume", cwd=tmp_path, cache=tmp_path / "cache"),
                          "has finished", "streamed training data ended there")
    assert (run / "config.json").read_bytes() == config
    assert [r["step"] for r in step_log(run)] == [1, 2]
    assert json.loads((run / "config.json").read_text())["train"]["max_steps"] == -(-100000 // (8 * 16))
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    checkpoint = run / "checkpoints" / "step00000002"
    assert torch.load(checkpoint / "mp_rank_00_model_states.pt", weights_only=False)["step"] == 2
    assert set(torch.load(checkpoint / "data_stream_rank0.pt", weights_only=False)) == {"step", "layout", "readers"}


def test_a_run_stopped_after_its_last_checkpoint_but_before_its_summary_resumes_to_write_it(tmp_path, lstm_run,
                                                                                            embedded_cache):
    """Killed between the last checkpoint and the summary: not finished, so --resume trains nothing and writes the
    summary (a finished run's resume is refused: tests/commands/test_bad_input.py)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lstm_run, run)
    (run / "summary.json").unlink()
    log = (run / "train_log.jsonl").read_bytes()
    run_cli("train", "--resume", "--out", str(run), cwd=tmp_path, cache=embedded_cache, check=True)
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert (run / "train_log.jsonl").read_bytes() == log
    assert_one_line_error(run_cli("train", "--resume", "--out", str(run), cwd=tmp_path, cache=embedded_cache),
                          "has finished")
