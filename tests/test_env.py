"""Tests of acoll._env: rank discovery from launcher variables (pure, no sockets)."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest

from acoll._env import (
    LaunchInfo,
    expand_nodelist,
    init_from_env,
    ompi_port,
    ranks_from_env,
    slurm_port,
    tasks_per_node,
)
from acoll._uid import UniqueId
from acoll.errors import InvalidUsage


def test_acoll_run_source() -> None:
    info = ranks_from_env({"ACOLL_RANK": "2", "ACOLL_WORLD_SIZE": "4", "ACOLL_LOCAL_RANK": "2",
                           "ACOLL_LOCAL_SIZE": "4", "ACOLL_COMM_ID": "127.0.0.1:29400"})
    assert info == LaunchInfo(2, 4, 2, 4, "127.0.0.1:29400", "acoll-run", "ACOLL_COMM_ID")


def test_torchrun_source_uses_master_port_plus_one() -> None:
    info = ranks_from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5",
                           "MASTER_PORT": "29500"})
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_size) == \
        ("torchrun", 3, 8, 1, 2)
    assert info.comm_id == "10.0.0.5:29501"


def test_master_port_at_top_of_range_goes_down() -> None:
    info = ranks_from_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h",
                           "MASTER_PORT": "65535"})
    assert info.comm_id == "h:65534"


def test_ipv6_master_addr_is_bracketed() -> None:
    info = ranks_from_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "fe80::1",
                           "MASTER_PORT": "100"})
    assert info.comm_id == "[fe80::1]:101"


def test_acoll_comm_id_overrides_master_addr() -> None:
    info = ranks_from_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a",
                           "MASTER_PORT": "1", "ACOLL_COMM_ID": "b:7"})
    assert (info.source, info.comm_id) == ("torchrun", "b:7")


def test_acoll_run_wins_over_torchrun_and_slurm() -> None:
    info = ranks_from_env({"ACOLL_RANK": "1", "ACOLL_WORLD_SIZE": "2",
                           "ACOLL_COMM_ID": "127.0.0.1:5000",
                           "RANK": "5", "WORLD_SIZE": "9", "MASTER_ADDR": "x",
                           "MASTER_PORT": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (info.source, info.rank, info.world_size) == ("acoll-run", 1, 2)


def test_local_rank_defaults_to_rank() -> None:
    info = ranks_from_env({"ACOLL_RANK": "1", "ACOLL_WORLD_SIZE": "2",
                           "ACOLL_COMM_ID": "127.0.0.1:5000"})
    assert (info.local_rank, info.local_size) == (1, None)


def test_empty_values_count_as_unset() -> None:
    info = ranks_from_env({"ACOLL_RANK": "", "RANK": "0", "WORLD_SIZE": "1",
                           "ACOLL_COMM_ID": "h:1"})
    assert info.source == "torchrun"


def test_openmpi_source() -> None:
    info = ranks_from_env({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                           "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "ACOLL_COMM_ID": "n1:9000"})
    assert info == LaunchInfo(5, 6, 2, 3, "n1:9000", "openmpi", "ACOLL_COMM_ID")


@pytest.mark.parametrize(("local_rank", "local_size"), [
    ({"MPI_LOCALRANKID": "1"}, {"MPI_LOCALNRANKS": "2"}),
    ({"PMI_LOCAL_RANK": "1"}, {"PMI_LOCAL_SIZE": "2"}),
])
def test_pmi_source(local_rank: dict[str, str], local_size: dict[str, str]) -> None:
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MASTER_ADDR": "m", "MASTER_PORT": "40",
           **local_rank, **local_size}
    info = ranks_from_env(env)
    assert info == LaunchInfo(3, 4, 1, 2, "m:41", "pmi", "MASTER_ADDR/MASTER_PORT")


@pytest.mark.parametrize("rank_var", ["OMPI_COMM_WORLD_RANK", "PMI_RANK"])
def test_mpi_needs_a_root_address(rank_var: str) -> None:
    size_var = "OMPI_COMM_WORLD_SIZE" if rank_var.startswith("OMPI") else "PMI_SIZE"
    with pytest.raises(InvalidUsage, match="ACOLL_COMM_ID"):
        ranks_from_env({rank_var: "0", size_var: "2"})


def test_mpi_wins_over_slurm_allocation_variables() -> None:
    # mpirun inside an sbatch allocation: SLURM_PROCID is the batch step's, not the rank.
    info = ranks_from_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                           "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "ACOLL_COMM_ID": "h:1"})
    assert (info.source, info.rank) == ("openmpi", 3)


def _slurm(**extra: str) -> dict[str, str]:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "2(x3),2",
           "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_JOB_ID": "123456"}
    env.update(extra)
    return env


def test_slurm_derives_root_from_nodelist_and_job_id() -> None:
    info = ranks_from_env(_slurm())
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_size) == \
        ("slurm", 5, 8, 1, 2)
    assert info.comm_id == f"gpu07:{20000 + 123456 % 20000}"


def test_slurm_step_nodelist_and_step_id() -> None:
    info = ranks_from_env(_slurm(SLURM_STEP_NODELIST="gpu[09-10]", SLURM_STEP_ID="2"))
    assert info.comm_id == f"gpu09:{slurm_port(123456, 2)}"
    assert slurm_port(123456, 2) != slurm_port(123456, 0)


def test_slurm_batch_step_sentinel_counts_as_step_zero() -> None:
    info = ranks_from_env(_slurm(SLURM_STEP_ID="4294967294"))
    assert info.comm_id == f"gpu07:{slurm_port(123456)}"


def test_slurm_ntasks_per_node_and_master_addr() -> None:
    info = ranks_from_env(_slurm(SLURM_NTASKS_PER_NODE="4", MASTER_ADDR="head",
                                 MASTER_PORT="29500"))
    assert (info.local_size, info.comm_id) == (4, "head:29501")


def test_slurm_without_nodelist_needs_an_address() -> None:
    env = _slurm()
    del env["SLURM_JOB_NODELIST"]
    with pytest.raises(InvalidUsage, match="SLURM_JOB_NODELIST"):
        ranks_from_env(env)


def test_slurm_bad_nodelist_names_the_variable() -> None:
    with pytest.raises(InvalidUsage, match="SLURM_JOB_NODELIST"):
        ranks_from_env(_slurm(SLURM_JOB_NODELIST="gpu[07-"))


def test_slurm_bad_node_id_names_the_variable() -> None:
    with pytest.raises(InvalidUsage, match="SLURM_NODEID"):
        ranks_from_env(_slurm(SLURM_NODEID="9"))


@pytest.mark.parametrize(("text", "hosts"), [
    ("gpu5", ["gpu5"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a,b[1],c", ["a", "b1", "c"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("rack1-node[1,3]-ib", ["rack1-node1-ib", "rack1-node3-ib"]),
])
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["", "n[1-", "n]1[", "n[3-1]", "n[a-b]", "a,,b", "[1-2]",
                                  "n[[1]]", "n[]"])
def test_expand_nodelist_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        expand_nodelist(text)


def test_tasks_per_node() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(ValueError):
        tasks_per_node("2(3)")


@pytest.mark.parametrize(("env", "names"), [
    ({}, "ACOLL_RANK"),
    ({"ACOLL_RANK": "0", "ACOLL_COMM_ID": "h:1"}, "ACOLL_WORLD_SIZE"),
    ({"ACOLL_RANK": "x", "ACOLL_WORLD_SIZE": "2", "ACOLL_COMM_ID": "h:1"}, "ACOLL_RANK='x'"),
    ({"ACOLL_RANK": "-1", "ACOLL_WORLD_SIZE": "2", "ACOLL_COMM_ID": "h:1"}, "ACOLL_RANK"),
    ({"ACOLL_RANK": "2", "ACOLL_WORLD_SIZE": "2", "ACOLL_COMM_ID": "h:1"},
     "ACOLL_RANK=2 must be < ACOLL_WORLD_SIZE=2"),
    ({"ACOLL_RANK": "0", "ACOLL_WORLD_SIZE": "0", "ACOLL_COMM_ID": "h:1"}, "ACOLL_WORLD_SIZE"),
    ({"ACOLL_RANK": "0", "ACOLL_WORLD_SIZE": "2"}, "ACOLL_COMM_ID"),
    ({"ACOLL_RANK": "0", "ACOLL_WORLD_SIZE": "2", "ACOLL_COMM_ID": "nocolon"},
     "ACOLL_COMM_ID"),
    ({"ACOLL_RANK": "0", "ACOLL_WORLD_SIZE": "2", "ACOLL_COMM_ID": "h:1",
      "ACOLL_LOCAL_RANK": "1", "ACOLL_LOCAL_SIZE": "1"},
     "ACOLL_LOCAL_RANK=1 must be < ACOLL_LOCAL_SIZE=1"),
    ({"ACOLL_RANK": "0", "ACOLL_WORLD_SIZE": "2", "ACOLL_COMM_ID": "h:1",
      "ACOLL_LOCAL_SIZE": "3"}, "ACOLL_LOCAL_SIZE=3 must be <= ACOLL_WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "5"}, "MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "p"},
     "MASTER_PORT='p'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
     "MASTER_PORT"),
    ({"RANK": "1", "WORLD_SIZE": "two", "MASTER_ADDR": "h", "MASTER_PORT": "5"},
     "WORLD_SIZE='two'"),
    ({"OMPI_COMM_WORLD_RANK": "0", "ACOLL_COMM_ID": "h:1"}, "OMPI_COMM_WORLD_SIZE"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "ACOLL_COMM_ID": "h:1"},
     "SLURM_PROCID=4 must be < SLURM_NTASKS=4"),
])
def test_bad_inputs_name_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(InvalidUsage) as info:
        ranks_from_env(env)
    assert names in str(info.value)
    assert isinstance(info.value, ValueError)


def test_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_RANK", "0")
    monkeypatch.setenv("ACOLL_WORLD_SIZE", "1")
    monkeypatch.setenv("ACOLL_COMM_ID", "127.0.0.1:1234")
    assert ranks_from_env().comm_id == "127.0.0.1:1234"


def test_init_from_env_calls_init_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The glue only: a stand-in ``acoll._communicator`` records the call."""
    calls: list[tuple[int, UniqueId, int, dict[str, object]]] = []

    async def fake_init_rank(nranks: int, uid: UniqueId, rank: int, **kw: object) -> str:
        calls.append((nranks, uid, rank, kw))
        return "comm"

    fake = types.ModuleType("acoll._communicator")
    fake.init_rank = fake_init_rank  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "acoll._communicator", fake)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    for name in ("ACOLL_RANK", "ACOLL_COMM_ID"):
        monkeypatch.delenv(name, raising=False)
    assert asyncio.run(init_from_env(timeout=5.0)) == "comm"
    [(nranks, uid, rank, kw)] = calls
    assert (nranks, rank, kw) == (2, 1, {"timeout": 5.0})
    assert uid == UniqueId.from_address("127.0.0.1:29501")
    assert uid.from_env


def _ompi(**extra: str) -> dict[str, str]:
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
           "PMIX_NAMESPACE": "1491075073"}
    env.update(extra)
    return env


def test_openmpi_single_host_derives_a_loopback_root() -> None:
    info = ranks_from_env(_ompi())
    assert info.comm_id == f"127.0.0.1:{ompi_port('1491075073')}"
    assert info.comm_id_from.startswith("single host")
    # every rank of the job derives the same address; another job another port
    assert ranks_from_env(_ompi(OMPI_COMM_WORLD_RANK="3",
                                OMPI_COMM_WORLD_LOCAL_RANK="3")).comm_id == info.comm_id
    assert ompi_port("1491075073") != ompi_port("1491075074")
    assert 22000 <= ompi_port("x") < 32000


def test_openmpi_jobid_fallback_and_explicit_address_wins() -> None:
    env = _ompi(OMPI_MCA_ess_base_jobid="77")
    del env["PMIX_NAMESPACE"]
    assert ranks_from_env(env).comm_id == f"127.0.0.1:{ompi_port('77')}"
    assert ranks_from_env(_ompi(ACOLL_COMM_ID="n1:9")).comm_id == "n1:9"


def test_openmpi_across_hosts_says_what_to_pass() -> None:
    with pytest.raises(InvalidUsage) as info:
        ranks_from_env(_ompi(OMPI_COMM_WORLD_LOCAL_SIZE="2"))
    text = str(info.value)
    assert "several hosts" in text
    assert "mpirun -x ACOLL_COMM_ID -x ACOLL_COMM_SECRET" in text


def test_pmi_says_what_to_pass() -> None:
    with pytest.raises(InvalidUsage, match=r"export ACOLL_COMM_ID=.*before mpiexec"):
        ranks_from_env({"PMI_RANK": "0", "PMI_SIZE": "1", "PMI_LOCAL_SIZE": "1"})
