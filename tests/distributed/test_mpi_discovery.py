"""MPI launches other than Open MPI: PMI variables, and mpi4py discovery (with a stand-in communicator)."""

from moe_scale.distributed.launch import fill_env_from_launcher, mpi_discovery


class FakeComm:
    """What mpi_discovery uses of mpi4py's COMM_WORLD, for rank `rank` of hosts `hosts`."""

    def __init__(self, rank: int, hosts: list[str], port: int = 31234):
        self.rank, self.hosts, self.port = rank, hosts, port

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.hosts)

    def allgather(self, value):
        return list(self.hosts)

    def bcast(self, value, root=0):
        return self.port


def test_mpi4py_discovery_maps_rank_world_local_rank_and_master():
    env: dict[str, str] = {}
    assert mpi_discovery(env, FakeComm(3, ["n1", "n1", "n2", "n2"]))
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")
    assert env["MASTER_ADDR"] == "n1" and env["MASTER_PORT"] == "31234"


def test_one_process_mpi_world_is_not_a_launch():
    env: dict[str, str] = {}
    assert not mpi_discovery(env, FakeComm(0, ["n1"])) and env == {}


def test_pmi_env():
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"}
    fill_env_from_launcher(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("2", "4", "0")
