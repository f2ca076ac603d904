"""What a command prints (moe_scale/console.py): its output and what helps, never the notices libraries print for
their own developers (DeepSpeed's communication op loaded, a FutureWarning per rank), and on a node shared by
several ranks the torch threads each runs with, once. The launchers' own lines are checked in
distributed/test_accelerate_launch.py, help pages in commands/test_help.py."""

from __future__ import annotations

import io
import re
import warnings

import pytest

from moe_scale.console import WithoutLines, deepspeed_stdout_to_stderr, drop_library_notices
from moe_scale.distributed.threads import usable_cores
from tests.cli_runs import TINY, assert_only_what_helps, cli_env, run_cli
from tests.paths import DS_CONFIGS


def test_without_lines_drops_whole_matching_lines_only():
    target = io.StringIO()
    stream = WithoutLines(target, re.compile(r"DeepSpeed \S+ built successfully"))
    for piece in ("first\nDeepSpeed op", "_x built successfully\n", "DeepSpeed op_x built successfully twice\n",
                  "last, no newline"):
        stream.write(piece)
    assert target.getvalue() == "first\nDeepSpeed op_x built successfully twice\n"
    stream.finish()
    assert target.getvalue().endswith("twice\nlast, no newline")


def test_deepspeeds_stdout_goes_to_stderr_without_its_op_notice(capsys):
    with deepspeed_stdout_to_stderr():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("Using /root/.cache/torch_extensions as PyTorch extensions root...")
    out, err = capsys.readouterr()
    assert out == "" and err == "Using /root/.cache/torch_extensions as PyTorch extensions root...\n"


def test_only_the_deprecated_gather_warning_is_dropped():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drop_library_notices()
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                      "`torch.distributed.all_gather_single` instead.", FutureWarning)
        warnings.warn("`torch.distributed.something_else` is deprecated.", FutureWarning)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated.", UserWarning)
    assert [(w.category, str(w.message)) for w in caught] == [
        (FutureWarning, "`torch.distributed.something_else` is deprecated."),
        (UserWarning, "`torch.distributed.all_gather_into_tensor` is deprecated.")]


def test_a_one_process_command_prints_no_library_notice(lstm_run, embedded_cache):
    proc = run_cli("eval", "--run", str(lstm_run), "--json", cwd=lstm_run.parent, cache=embedded_cache, check=True)
    assert_only_what_helps(proc)
    assert "threads:" not in proc.stderr   # alone on its node: torch's own count, nothing to say


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_process_zero2_run_prints_no_library_notice_and_its_threads_once(tmp_path, embedded_cache):
    env = cli_env(embedded_cache)
    del env["OMP_NUM_THREADS"]   # as a user starts it: moe_scale chooses
    proc = run_cli("train", *TINY, "--max-steps", "4", "--ep-size", "2", "--ds-config",
                   str(DS_CONFIGS / "zero2_ep.json"), "--out", str(tmp_path / "run"), cwd=tmp_path, env=env,
                   nprocs=2, check=True)
    assert_only_what_helps(proc)
    cores = usable_cores()
    line = (f"moe-scale: threads: {max(1, cores // 2)} per process ({cores} cores, 2 local ranks; set "
            f"OMP_NUM_THREADS to override)")
    assert proc.stderr.splitlines().count(line) == 1, proc.stderr
    assert "threads:" not in proc.stdout
