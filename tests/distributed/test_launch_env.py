"""Launcher environments map onto torch.distributed's env:// variables."""

import pytest

from moe_scale.distributed.launch import _first_slurm_host, fill_env_from_launcher


def test_first_slurm_host():
    assert _first_slurm_host("gpu[003-005,009],cpu01") == "gpu003"
    assert _first_slurm_host("node7") == "node7"
    assert _first_slurm_host("a-b[10,12]") == "a-b10"


def test_slurm_env():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[03-04]",
           "SLURM_JOB_ID": "123456"}
    fill_env_from_launcher(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("5", "16", "1")
    assert env["MASTER_ADDR"] == "gpu03" and env["MASTER_PORT"] == str(29500 + 456)


def test_launcher_variables_win_over_slurm():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    fill_env_from_launcher(env)
    assert (env["RANK"], env["WORLD_SIZE"]) == ("1", "2")


def test_open_mpi_env():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}
    fill_env_from_launcher(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "3")


def test_single_process_defaults():
    env = {}
    fill_env_from_launcher(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("0", "1", "0", "127.0.0.1")
    assert 0 < int(env["MASTER_PORT"]) < 65536


def _shutdown_rank(rank: int, world_size: int, port: int, results) -> None:
    import torch

    from moe_scale.distributed.launch import shutdown_distributed

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world_size)
    shutdown_distributed()
    results.put((rank, torch.distributed.is_initialized()))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.multiprocess
def test_shutdown_destroys_a_multi_rank_group_and_keeps_a_single_one():
    """Several ranks leave their process group before exit (gloo could abort a finished rank otherwise); one
    process keeps it, so in-process callers can run another command."""
    import multiprocessing as mp

    from moe_scale.distributed.ports import free_port

    ctx = mp.get_context("spawn")
    for world_size, still_up in ((2, False), (1, True)):
        results, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_shutdown_rank, args=(r, world_size, port, results)) for r in range(world_size)]
        for p in procs:
            p.start()
        seen = sorted(results.get(timeout=120) for _ in range(world_size))
        for p in procs:
            p.join(timeout=30)
        assert seen == [(r, still_up) for r in range(world_size)]
        assert [p.exitcode for p in procs] == [0] * world_size


def test_main_shuts_down_only_after_success(monkeypatch):
    import moe_scale.cli as cli
    from moe_scale.distributed import launch

    calls = []
    monkeypatch.setattr(launch, "shutdown_distributed", lambda: calls.append(1))
    assert cli.main(["flops", "--list"]) == 0 and calls == [1]
    assert cli.main(["flops", "--preset", "no-such-preset"]) == 2 and calls == [1]


@pytest.mark.parametrize("accelerator", ["cuda", "cpu"])
def test_gpu_rank_sets_its_device_before_the_first_collective(monkeypatch, accelerator):
    """NCCL binds a communicator to the current device: set_device comes before DeepSpeed's init (whose barrier is the
    first collective)."""
    import deepspeed
    import torch

    from moe_scale.distributed import launch

    calls = []
    monkeypatch.setattr(launch, "select_accelerator", lambda: accelerator)
    for name, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", str(device))))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: bool(calls and calls[-1][0] != "set_device"))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: calls.append(("init", kw["dist_backend"])))
    monkeypatch.setattr(launch, "_log_threads", lambda: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    env = launch.init_distributed()
    if accelerator == "cuda":
        assert calls == [("set_device", "cuda:3"), ("init", "nccl")]
        assert (env.device, env.backend) == (torch.device("cuda", 3), "nccl")
    else:
        assert calls == [("init", "gloo")]
        assert (env.device, env.backend) == (torch.device("cpu"), "gloo")
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 3)
