"""`accelerate launch` as the third launcher: its DeepSpeed plugin's JSON becomes --ds-config (conflicts are one
line), and 2 CPU processes started with the shipped accelerate config train exactly as the deepspeed launcher's
(the README's command), as do the ranks the tests start themselves (tests/cli_runs.py); neither launcher's run
shows a notice not meant for users (tests/test_console.py)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from moe_scale.distributed.accelerate_env import ds_config_from_accelerate
from moe_scale.errors import UserError
from moe_scale.distributed.ports import free_port
from tests.cli_runs import TINY, assert_only_what_helps, cli_env, launch_train, run_train, step_log
from tests.paths import REPO

ZERO2 = str(REPO / "ds_configs" / "zero2_ep.json")
PLUGIN = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO2}


def test_the_plugins_json_is_the_ds_config():
    assert ds_config_from_accelerate(None, {}) is None                              # not under accelerate
    assert ds_config_from_accelerate("mine.json", {"ACCELERATE_MIXED_PRECISION": "bf16"}) == "mine.json"
    assert ds_config_from_accelerate(None, PLUGIN) == ZERO2
    assert ds_config_from_accelerate(ZERO2, PLUGIN) == ZERO2                         # the same file twice: fine
    assert ds_config_from_accelerate("x.json", {"ACCELERATE_USE_DEEPSPEED": "true"}) == "x.json"


@pytest.mark.parametrize("env, words", [
    ({**PLUGIN, "ACCELERATE_MIXED_PRECISION": "bf16"}, "mixed_precision bf16 is not enabled in"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "sets zero_stage without a "
                                                                                  "deepspeed_config_file"),
])
def test_settings_moe_scale_cannot_take_are_refused(env, words):
    with pytest.raises(UserError, match=words):
        ds_config_from_accelerate(None, env)
    with pytest.raises(UserError, match="differ"):
        ds_config_from_accelerate("other.json", PLUGIN)


# Size: TINY for 4 steps; the time is three 2-process starts (the deepspeed launcher, accelerate launch, the forked
# ranks), whose equality is the point.
@pytest.mark.slow
@pytest.mark.multiprocess
def test_accelerate_launch_trains_as_the_deepspeed_launcher(tmp_path, embedded_cache):
    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate command is not on PATH")
    settings = [*TINY, "--max-steps", "4", "--log-interval", "1", "--ep-size", "2", "--noise-rng", "global"]
    reference = tmp_path / "deepspeed"
    launched = launch_train([*settings, "--ds-config", ZERO2, "--out", str(reference)], cwd=tmp_path,
                            cache=embedded_cache)
    assert_only_what_helps(launched)   # with the README's launcher flags: no CUDA_VISIBLE_DEVICES on CPU
    run = tmp_path / "accelerate"
    proc = subprocess.run(["accelerate", "launch", "--config_file", str(REPO / "ds_configs" /
                                                                          "accelerate_deepspeed.yaml"),
                           "--main_process_port", str(free_port()), "-m", "moe_scale", "train", *settings,
                           "--out", str(run)], cwd=REPO, env=cli_env(embedded_cache), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_only_what_helps(proc)
    assert json.loads((run / "config.json").read_text())["parallel"]["ds_config"] == "ds_configs/zero2_ep.json"
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    assert [r["loss"] for r in step_log(run)] == [r["loss"] for r in step_log(reference)]
    forked = tmp_path / "forked"   # the ranks every other multi-process test starts
    run_train([*settings, "--ds-config", ZERO2, "--out", str(forked)], cwd=tmp_path, cache=embedded_cache, nprocs=2)
    assert [r["loss"] for r in step_log(forked)] == [r["loss"] for r in step_log(reference)]
