"""A real one-node SLURM cluster on localhost (slurmctld + slurmd, munge auth, 2 CPUs) runs the CPU sbatch
template; the job log must show training steps with TFLOPS/device.

Installs Debian's `slurm-wlm` and `munge` with apt-get when they are missing. Skips only where that is
impossible (not root, or no apt-get); an install or cluster failure fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from moe_scale.distributed.ports import free_port
from tests.paths import REPO, DS_CONFIGS

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "munged")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def _ensure_slurm_installed() -> None:
    if all(_which(b) for b in BINARIES):
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        pytest.skip("SLURM is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"],
                ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    missing = [b for b in BINARIES if not _which(b)]
    assert not missing, f"installed slurm-wlm and munge but {missing} are still missing"


SLURM_CONF = """\
ClusterName=moetest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
NodeName=localhost CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _munge_running() -> bool:
    return subprocess.run([_which("munge") or "munge", "-n"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory):
    """(environment with SLURM_CONF, directory) of a running one-node cluster; torn down afterwards."""
    _ensure_slurm_installed()
    if os.geteuid() != 0:
        pytest.skip("starting slurmd and munged needs root")
    started: list[subprocess.Popen] = []
    tmp_path = tmp_path_factory.mktemp("slurm_cluster")
    d = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(d=d, ctld_port=free_port(), slurmd_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        if not _munge_running():
            key = Path("/etc/munge/munge.key")
            if not key.exists():
                key.parent.mkdir(parents=True, exist_ok=True)
                key.write_bytes(os.urandom(1024))
                key.chmod(0o400)
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            started.append(subprocess.Popen([_which("munged"), "--foreground", "--force"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            _wait(_munge_running, 30, "munged did not start")
        started.append(subprocess.Popen([_which("slurmctld"), "-D", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        started.append(subprocess.Popen([_which("slurmd"), "-D", "-N", "localhost", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))

        def idle() -> bool:
            out = subprocess.run([_which("sinfo"), "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            return out.stdout.strip() == "idle"

        _wait(idle, 90, f"the node never became idle; logs in {d}")
        yield env
    finally:
        for proc in reversed(started):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait(condition, seconds: float, message: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(1)
    raise AssertionError(message)


def _job_state(env: dict, job: str) -> tuple[str, str]:
    """(JobState, ExitCode) of a job from slurmctld."""
    out = subprocess.run([_which("scontrol"), "show", "job", "-o", job], env=env, capture_output=True, text=True)
    fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
    return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "")


def _sbatch_and_check(env: dict, work: Path, template: str, sbatch_flags: list[str], job_env: dict) -> str:
    """Submit, then ask slurmctld for the job's state every 0.2 s (`sbatch --wait` polls at growing intervals
    and noticed a 10 s job's end after 42 s)."""
    log, run = work / "job.out", work / "run"
    cmd = [_which("sbatch"), "--parsable", f"--chdir={work}", f"--output={log}", "--nodes=1", *sbatch_flags,
           str(REPO / "slurm" / template), "--preset", "lm1b-moe-32-mini", "--ep-size", "2", "--max-steps", "20",
           "--log-interval", "10", "--eval-interval", "20", "--out", str(run)]
    proc = subprocess.run(cmd, cwd=work, env={**env, **job_env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    job = proc.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 600
    while (state := _job_state(env, job))[0] in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING") \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    text = log.read_text() if log.exists() else ""
    assert state == ("COMPLETED", "0:0"), f"job {job}: {state}\n" + text[-4000:]
    steps = [line for line in text.splitlines() if line.startswith("step ") and "TFLOPS/device" in line]
    assert [line.split()[1] for line in steps] == ["10/20", "20/20"], text[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tflops_per_device"] > 0
    assert 0 < summary["all_to_all_share"] < 1
    return text


# Size: the shipped template as a user submits it, on a real one-node cluster (started once for both tests).
def test_cpu_template_trains_under_real_slurm(local_slurm, tmp_path):
    """The srun path: two SLURM tasks, ranks from SLURM_PROCID / SLURM_NTASKS."""
    _sbatch_and_check(local_slurm, tmp_path, "train_lstm_moe_cpu.sbatch", ["--ntasks-per-node=2"],
                      {"DS_CONFIG": str(DS_CONFIGS / "zero2_ep.json")})


# Size: as above; the deepspeed launcher inside the job is the point.
def test_deepspeed_template_trains_under_real_slurm(local_slurm, tmp_path):
    """The deepspeed-launcher path: a hostfile from the allocation, one launcher per node with --no_ssh
    --node_rank, two CPU processes per node."""
    text = _sbatch_and_check(local_slurm, tmp_path, "train_deepspeed.sbatch",
                             ["--ntasks-per-node=1", "--cpus-per-task=2", "--gpus-per-node=0"],
                             {"PROCS_PER_NODE": "2", "DS_CONFIG": str(DS_CONFIGS / "zero2_ep.json")})
    assert "--no_ssh" in text or "node_rank=0" in text
    hostfiles = list(tmp_path.glob("hostfile-*"))
    assert len(hostfiles) == 1 and hostfiles[0].read_text().strip() == "localhost slots=2"
