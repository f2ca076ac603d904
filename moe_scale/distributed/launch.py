"""Process-group setup for every way moe_scale is started.

- `deepspeed --num_gpus N moe-scale train ...` (or torchrun): RANK/WORLD_SIZE/MASTER_* are set.
- `srun moe-scale train ...` on SLURM: we derive them from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and the
  first host of the job's node list.
- `mpirun -np N moe-scale train ...` (Open MPI): from OMPI_COMM_WORLD_*; MPICH / Intel MPI: PMI_RANK/PMI_SIZE;
  any other MPI launch: asked from mpi4py when it is installed (`mpi_discovery`).
- plain `moe-scale train`: a one-process group on 127.0.0.1.

On machines without CUDA, DS_ACCELERATOR=cpu and the gloo backend are used; this must happen before the
first `import deepspeed`, which is why cli.py calls `select_accelerator()` first.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass, replace

import torch

from moe_scale.console import deepspeed_stdout_to_stderr
from moe_scale.deepspeed_internals import without_cpu_comm_op
from moe_scale.distributed.ports import free_port
from moe_scale.distributed.threads import thread_share


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def select_accelerator() -> str:
    """Set DS_ACCELERATOR=cpu unless CUDA is usable (or the user chose). Returns the accelerator name."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    return os.environ.get("DS_ACCELERATOR", "cuda")


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as 'gpu[003-005,009],cpu01' -> 'gpu003'."""
    match = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        return nodelist
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def fill_env_from_launcher(env: dict[str, str] | None = None) -> None:
    """Derive torch.distributed's env:// variables from SLURM or MPI when no launcher set them."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        pass
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("MASTER_ADDR", _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
        env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
    elif "OMPI_COMM_WORLD_RANK" in env:
        env["RANK"], env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"]
        env["LOCAL_RANK"] = env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
    elif "PMI_RANK" in env and "PMI_SIZE" in env:   # MPICH / Intel MPI (hydra)
        env["RANK"], env["WORLD_SIZE"] = env["PMI_RANK"], env["PMI_SIZE"]
        env["LOCAL_RANK"] = env.get("MPI_LOCALRANKID", env.get("PMI_LOCAL_RANK", "0"))
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
    elif mpi_discovery(env):
        pass
    else:
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = "0", "1", "0"
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
    env.setdefault("LOCAL_RANK", "0")


def mpi_discovery(env: dict[str, str], comm=None) -> bool:
    """Any other MPI launch (srun --mpi=pmix, mpiexec of another MPI): ask mpi4py, when it is installed and
    the world has more than one process. Rank 0's hostname becomes MASTER_ADDR; local rank is the rank
    among the processes on the same host."""
    if comm is None:
        if env.get("MOE_SCALE_MPI_DISCOVERY", "1") == "0":
            return False
        try:
            from mpi4py import MPI
        except ImportError:
            return False
        comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        return False
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    env["RANK"], env["WORLD_SIZE"] = str(rank), str(size)
    env["LOCAL_RANK"] = str(hosts[:rank].count(hosts[rank]))
    env.setdefault("MASTER_ADDR", hosts[0])
    env.setdefault("MASTER_PORT", str(comm.bcast(free_port() if rank == 0 else None, root=0)))
    return True


def ranks_per_node(node_size: int) -> int:
    """--node-size, else the launcher's count of processes on this node."""
    if node_size:
        return node_size
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    raise ValueError("hierarchical all-to-all needs the ranks per node: pass --node-size (the launcher set "
                     "none of LOCAL_WORLD_SIZE, LOCAL_SIZE, SLURM_NTASKS_PER_NODE)")


def init_deepspeed_comm(backend: str, **options) -> None:
    """deepspeed.init_distributed (DeepSpeed's communication over torch.distributed, what its engine and expert groups
    use) without its CPU communication op: nothing compiled on a machine's first run, nothing loaded, no 66 MB
    /dev/shm segment per rank (deepspeed_internals.without_cpu_comm_op). Every process of moe_scale, its tools and
    its tests initialises DeepSpeed through here."""
    import deepspeed

    with without_cpu_comm_op():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, **options)


def init_distributed() -> DistEnv:
    """Initialise torch.distributed through DeepSpeed (idempotent) and describe this process.

    On GPUs the rank's device is set before the first collective: NCCL binds a communicator to the current device,
    so a barrier before set_device would put every rank of a node on GPU 0 (a hang, or its memory filled)."""
    accelerator = select_accelerator()   # before DeepSpeed's import: it picks its accelerator then
    fill_env_from_launcher()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator == "cpu":
        backend, device = "gloo", torch.device("cpu")
    else:
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        with deepspeed_stdout_to_stderr():   # DeepSpeed's progress lines are not the command's output
            init_deepspeed_comm(backend)
        _log_threads()
    return DistEnv(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device, backend)


def _log_threads() -> None:
    """One line per node where several ranks share it: the torch threads each runs with (distributed/threads.py;
    cli.main set them)."""
    share = replace(thread_share(), threads=torch.get_num_threads())
    if share.local_ranks > 1 and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"moe-scale: {share.describe()}", file=sys.stderr, flush=True)


def shutdown_distributed() -> None:
    """Leave torch.distributed together: a barrier, then destroy_process_group (collective; every rank calls it
    after a command that succeeded). A process group left for the interpreter's exit to tear down can abort a
    rank in gloo's threads ("terminate called without an active exception", status -6) after a finished run.
    Only for several ranks: one process has no peers to race, and a command called in-process (tests,
    notebooks) keeps its group and DeepSpeed's cached expert groups usable for the next call."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
