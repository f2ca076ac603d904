"""Launcher environments map onto torch.distributed's env:// variables."""

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
