"""tools/bench_threads.py: both thread settings of a 2-process run at a tiny size, end to end; one process's four
settings; flag errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_scale.distributed.threads import usable_cores
from tests.paths import TOOLS

TOOL = TOOLS / "bench_threads.py"
TINY = ["--extra", "--d-model", "16", "--expert-hidden", "16", "--seq-len", "8", "--batch-size", "8",
        "--num-experts", "4", "--vocab-size", "500", "--log-interval", "5"]


# Size: --max-steps 5 (the tool's minimum) at d 16; the time is two deepspeed-launcher runs of 2 processes, one of
# them with torch's default threads on every rank (the oversubscribed "before" this tool exists to measure).
@pytest.mark.slow
@pytest.mark.multiprocess
def test_before_and_after_on_2_processes(tmp_path):
    out = tmp_path / "threads.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--max-steps", "5", "--timeout", "280", "--out", str(out),
                           *TINY], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    cores = usable_cores()
    assert (report["procs"], report["cores"], report["max_steps"]) == (2, cores, 5)
    before, after = report["before"], report["after"]
    assert (before["omp_num_threads"], before["threads_per_process"]) == (str(cores), cores)   # torch's old count
    assert (after["omp_num_threads"], after["threads_per_process"]) == (None, max(1, cores // 2))
    for side in (before, after):
        assert len(side["runs"]) == 1 and side["tokens_per_s"] == side["runs"][0]["tokens_per_s"] > 0
    assert report["ratio"] == after["tokens_per_s"] / before["tokens_per_s"]
    assert report["command"].startswith("deepspeed --log_level warning --num_gpus 2 --module moe_scale train "
                                        "--ep-size 2 --ds-config ds_configs/zero2_ep.json --max-steps 5 ")


def test_one_process_compares_four_settings():
    """--procs 1 (the quickstart on a busy machine): torch's count, moe_scale's, passive wait, one thread."""
    import bench_threads

    got = bench_threads.settings(2, 1)
    assert got == {"before": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": None},
                   "after": {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None},
                   "passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
                   "one": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": None}}
    assert bench_threads.settings(2, 2).keys() == {"before", "after"}
    args = bench_threads.parse_args(["--procs", "1", "--load", "3", "--max-steps", "7"])
    assert bench_threads.command(args, bench_threads.Path("r"))[1:5] == ["-m", "moe_scale", "train", "--max-steps"]


@pytest.mark.parametrize("flags, message", [
    (["--load", "-1"], "expected an integer >= 0"),
    (["--max-steps", "3"], "at least 5"),
    (["--extra", "--ep-size", "4"], "must not set ['--ep-size']"),
    (["--out", "no/such/dir/x.json"], "does not exist"),
    (["--repeats", "0"], "positive integer"),
    (["--timeout", "-1"], "positive integer"),
])
def test_flag_errors_are_one_line(tmp_path, flags, message):
    proc = subprocess.run([sys.executable, str(TOOL), *flags], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
