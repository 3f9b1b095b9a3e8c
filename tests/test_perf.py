"""acoll-perf: sweeps of every collective, the result check, JSON/plot output, --vs gloo."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from acoll import ReduceOp, perf
from acoll._dtypes import parse_dtype

SWEEP = ["-b", "8", "-e", "64K", "-f", "8", "-n", "2", "-w", "1"]
SIZES = [8, 64, 512, 4096, 32768]
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
_LAUNCHER_VARS = ("ACOLL_RANK", "ACOLL_WORLD_SIZE", "ACOLL_LOCAL_RANK", "ACOLL_LOCAL_SIZE",
                  "ACOLL_COMM_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.setdefault("ACOLL_SOCKET_IFNAME", "=lo")
    env["ACOLL_TIMEOUT"] = "30"
    return env


def run_perf(*args: str, timeout: float = 60,
             launcher: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [*(launcher or []), sys.executable, "-m", "acoll.perf", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                          check=False)


def parse_table(out: str) -> list[dict[str, Any]]:
    """The data rows of an acoll-perf table: leading columns plus one dict per mode."""
    rows = []
    for line in out.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split()
        if len(f) not in (9, 13):
            continue  # the comparison table of --vs
        row: dict[str, Any] = {"size": int(f[0]), "count": int(f[1]), "type": f[2],
                               "redop": f[3], "root": int(f[4]), "modes": []}
        for i in range(5, len(f), 4):
            row["modes"].append({"time": f[i], "algbw": f[i + 1], "busbw": f[i + 2],
                                 "wrong": f[i + 3]})
        rows.append(row)
    return rows


def _footer_wrong(out: str) -> int:
    line = next(x for x in out.splitlines() if x.startswith("# Out of bounds values"))
    return int(line.split(":")[1].split()[0])


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("coll", ["all_reduce", "broadcast", "reduce", "all_gather",
                                  "reduce_scatter", "all_to_all", "sendrecv"])
def test_sweep_is_correct(coll: str, nranks: int) -> None:
    res = run_perf(coll, "-N", str(nranks), *SWEEP, "-r", str(nranks - 1))
    assert res.returncode == 0, res.stderr + res.stdout
    assert f"ranks {nranks}" in res.stdout
    assert "#wrong" in res.stdout
    assert "busbw" in res.stdout
    assert "in-place" in res.stdout
    rows = parse_table(res.stdout)
    assert [r["size"] for r in rows] == [
        s // 4 // (nranks if coll in ("all_gather", "reduce_scatter", "all_to_all") else 1)
        * 4 * (nranks if coll in ("all_gather", "reduce_scatter", "all_to_all") else 1)
        for s in SIZES]
    for r in rows:
        assert r["type"] == "float32"
        assert r["redop"] == ("sum" if coll in ("all_reduce", "reduce", "reduce_scatter")
                              else "none")
        assert r["root"] == (nranks - 1 if coll in ("broadcast", "reduce") else -1)
        assert len(r["modes"]) == 2
        out_of_place = r["modes"][0]
        assert out_of_place["wrong"] == "0"
        assert float(out_of_place["time"]) > 0
        for mode in r["modes"]:
            assert mode["wrong"] in ("0", "N/A")
    assert _footer_wrong(res.stdout) == 0
    assert "# Avg bus bandwidth" in res.stdout


@pytest.mark.parametrize("coll", ["tcp", "barrier"])
def test_tcp_and_barrier(coll: str) -> None:
    res = run_perf(coll, "-N", "2", *SWEEP)
    assert res.returncode == 0, res.stderr + res.stdout
    rows = parse_table(res.stdout)
    assert rows
    assert all(len(r["modes"]) == 1 for r in rows)
    if coll == "tcp":
        assert [r["size"] for r in rows] == SIZES
        assert all(r["modes"][0]["wrong"] == "0" for r in rows)
        assert all(r["type"] == "uint8" and r["count"] == r["size"] for r in rows)


def test_json_records(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = run_perf("all_reduce", "-N", "2", *SWEEP, "-d", "bfloat16", "-o", "avg",
                   "--json", str(out))
    assert res.returncode == 0, res.stderr + res.stdout
    doc = json.loads(out.read_text())
    assert doc["tool"] == "acoll-perf"
    assert doc["command"].startswith("acoll-perf all_reduce -N 2")
    assert {"hostname", "cpu_count"} <= set(doc["machine"])
    assert doc["date"]
    assert doc["acoll_version"]
    assert doc["settings"]["nranks"] == 2
    assert doc["settings"]["dtype"] == "bfloat16"
    assert doc["out_of_bounds"] == 0
    assert doc["peer"] is None
    recs = doc["records"]
    assert len(recs) == 2 * len(SIZES)
    assert {(r["size"], r["inplace"]) for r in recs} == {(s, m) for s in SIZES
                                                         for m in (False, True)}
    for r in recs:
        assert set(r) >= {"size", "count", "type", "redop", "root", "inplace", "time_us",
                          "algbw", "busbw", "wrong"}
        assert r["wrong"] == 0
        assert r["count"] == r["size"] // 2
        assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (2 - 1) / 2)


def test_check_detects_wrong_results() -> None:
    res = run_perf("all_gather", "-N", "2", *SWEEP, "--inject-error")
    assert res.returncode == 1
    rows = parse_table(res.stdout)
    assert all(int(m["wrong"]) >= 1 for r in rows for m in r["modes"])
    assert _footer_wrong(res.stdout) >= len(rows)
    assert "FAILED" in res.stdout


def test_check_off_prints_na() -> None:
    res = run_perf("all_reduce", "-N", "2", *SWEEP, "-c", "0", "--inject-error")
    assert res.returncode == 0, res.stderr
    assert all(m["wrong"] == "N/A" for r in parse_table(res.stdout) for m in r["modes"])


def test_single_rank_without_launcher() -> None:
    res = run_perf("all_reduce", *SWEEP, "-d", "int8", "-o", "max", "--no-inplace",
                   "--loop", "asyncio")
    assert res.returncode == 0, res.stderr + res.stdout
    assert "ranks 1" in res.stdout
    assert "loop asyncio" in res.stdout
    rows = parse_table(res.stdout)
    assert len(rows) == len(SIZES)
    assert all(len(r["modes"]) == 1 and r["modes"][0]["wrong"] == "0" for r in rows)


def test_under_acoll_run() -> None:
    res = run_perf("reduce_scatter", *SWEEP, "-o", "prod",
                   launcher=[sys.executable, "-m", "acoll.run", "-n", "2", "--no-prefix",
                             "--"])
    assert res.returncode == 0, res.stderr + res.stdout
    assert res.stdout.count("# Avg bus bandwidth") == 1  # rank 0 only
    assert "ranks 2" in res.stdout
    assert _footer_wrong(res.stdout) == 0


@pytest.mark.parametrize(("args", "message"), [
    (["all_reduce", "-d", "complex64"], "dtype"),
    (["all_reduce", "-o", "xor"], "op"),
    (["broadcast", "-N", "2", "-r", "2"], "root"),
    (["all_reduce", "-b", "1Q"], "not a size"),
    (["sendrecv", "-b", "8"], "at least 2 ranks"),
    (["all_reduce", "-N", "2", "--rounds", "0"], "--rounds must be >= 1"),
    (["all_reduce", "--rounds", "2"], "--rounds needs -N"),
    # (session 56's review: these failed after the sweep, or meant something else)
    (["all_reduce", "-N", "2", "--timeout", "0"], "--timeout must be a positive"),
    (["all_reduce", "-N", "2", "--timeout", "nan"], "--timeout must be a positive"),
    (["all_reduce", "--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: no folder"),
])
def test_usage_errors(args: list[str], message: str) -> None:
    res = run_perf(*args)
    assert res.returncode == 2
    assert message in res.stderr


def test_rounds_report_medians(tmp_path: Path) -> None:
    """-N with --rounds: the job runs R times; the JSON holds per-record medians."""
    out = tmp_path / "r.json"
    res = run_perf("all_reduce", "-N", "2", *SWEEP, "--rounds", "3", "--json", str(out))
    assert res.returncode == 0, res.stderr + res.stdout
    assert res.stdout.count("# Avg bus bandwidth") == 3  # each round's own table
    doc = json.loads(out.read_text())
    assert doc["settings"]["rounds"] == 3
    assert doc["out_of_bounds"] == 0
    assert len(doc["records"]) == 2 * len(SIZES)


def test_median_result_and_round_ratios() -> None:
    """Medians per record (bandwidths follow the median time), wrong elements add up, and
    each round's ratio pairs acoll's round k with the peer's round k."""
    from acoll.perf.report import Record, Result, median_result, round_ratios

    def result(backend: str, t: float, wrong: int = 0) -> Result:
        recs = [Record(1024, 256, "float32", "sum", -1, True, t, 1.0 / t, 2.0 / t, wrong),
                Record(2048, 512, "float32", "sum", -1, True, None, None, None, None, "N/A")]
        return Result(backend, {"nranks": 2}, recs, [f"note {backend}"])

    mine = [result("acoll", t, w) for t, w in ((1.0, 0), (4.0, 2), (2.0, 0))]
    med = median_result(mine)
    assert med.settings == {"nranks": 2, "rounds": 3}
    assert med.records[0].time_us == 2.0
    assert med.records[0].busbw == pytest.approx(1.0)
    assert med.records[0].algbw == pytest.approx(0.5)
    assert med.records[0].wrong == 2
    assert med.records[1].time_us is None
    assert med.notes == ["note acoll"]
    peers = [result("mpi", t) for t in (2.0, 2.0, 1.0)]
    assert round_ratios(mine, peers) == {(1024, True): [2.0, 0.5, 0.5]}

    # N/A in the first round only: the other rounds count, and so do their wrong elements
    late = [result("acoll", t, w) for t, w in ((1.0, 0), (4.0, 4), (2.0, 0))]
    late[0].records[0] = Record(1024, 256, "float32", "sum", -1, True, None, None, None,
                                None, "N/A")
    med = median_result(late)
    assert med.records[0].time_us == 3.0
    assert med.records[0].busbw == pytest.approx(2.0 / 3.0)
    assert med.records[0].wrong == 4
    assert med.records[0].note == "measured in 2 of 3 rounds"
    # matched by (size, mode), not position: a round with its records in another order
    swapped = [result("acoll", 1.0), result("acoll", 3.0)]
    swapped[1].records.reverse()
    assert median_result(swapped).records[0].time_us == 2.0


def test_rounds_without_peer_print_medians() -> None:
    from acoll.perf.report import Record, Result, median_result, report

    rounds = [Result("acoll", {"nranks": 2}, [Record(8, 2, "float32", "sum", -1, True, t,
                                                     1.0, 1.0, 0)], []) for t in (5.0, 7.0)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        report(median_result(rounds), None, argv=[], json_path=None, plot_path=None)
    assert "# medians of 2 rounds" in buf.getvalue()
    assert "6.00" in buf.getvalue()


def test_vs_nccl_without_cuda_is_clear() -> None:
    if HAS_TORCH:
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA present: --vs nccl would run")
    res = run_perf("all_reduce", "-N", "2", "-b", "8", "--vs", "nccl")
    assert res.returncode == 2
    assert ("CUDA" in res.stderr) if HAS_TORCH else ("PyTorch" in res.stderr)


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install 'acoll[bench]')")
def test_vs_gloo(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    res = run_perf("all_reduce", "-N", "2", "-b", "8", "-e", "4K", "-f", "8", "-n", "2",
                   "-w", "1", "--vs", "gloo", "--json", str(out), timeout=120)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "torch.distributed gloo" in res.stdout
    assert "acoll vs gloo" in res.stdout
    doc = json.loads(out.read_text())
    assert doc["peer"]["backend"] == "gloo"
    assert doc["peer"]["out_of_bounds"] == 0
    assert len(doc["peer"]["records"]) == 2 * 4
    assert [c["size"] for c in doc["comparison"]] == [8, 64, 512, 4096]
    for c in doc["comparison"]:
        assert c["time_ratio"] == pytest.approx(c["peer_time_us"] / c["acoll_time_us"])


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed (pip install "
                    "'acoll[plot]')")
def test_plot(tmp_path: Path) -> None:
    png = tmp_path / "p.png"
    res = run_perf("all_reduce", "-N", "2", "-b", "1K", "-e", "8K", "-f", "8", "-n", "1",
                   "-w", "0", "--plot", str(png))
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- in-process units ------------------------------------------------------------------------

def test_bus_factors_and_counts() -> None:
    assert perf.bus_factor("all_reduce", 4) == 1.5
    assert perf.bus_factor("all_gather", 4) == 0.75
    assert perf.bus_factor("reduce_scatter", 2) == 0.5
    assert perf.bus_factor("all_to_all", 4) == 0.75
    assert perf.bus_factor("broadcast", 8) == perf.bus_factor("sendrecv", 8) == 1.0
    assert perf._counts("all_gather", 64, 4, 4) == (4, 16, 4)
    assert perf._counts("reduce_scatter", 64, 4, 4) == (16, 4, 4)
    assert perf._counts("all_to_all", 64, 4, 4) == (16, 16, 4)
    assert perf._counts("all_reduce", 64, 4, 4) == (16, 16, 16)
    assert perf.sweep_sizes(8, 64, 2) == [8, 16, 32, 64]
    assert perf.sweep_sizes(8, 40, 2, step=16) == [8, 24, 40]


@pytest.mark.parametrize("dtype", ["int8", "uint8", "float16", "bfloat16", "float32"])
def test_count_wrong_sees_every_bad_element(dtype: str) -> None:
    dt = parse_dtype(dtype)
    exp = perf._values(1, np.arange(1000, dtype=np.int64), "data", dt)
    got = exp.copy()
    assert perf.count_wrong(got, exp) == 0
    got[[3, 500, 999]] += dt.type(1)
    assert perf.count_wrong(got, exp) == 3
    if dt.kind == "f" or dtype == "bfloat16":
        got[7] = np.nan
        assert perf.count_wrong(got, exp) == 4
        assert perf.count_wrong(got, exp, approx=3) == 4


def test_reference_matches_a_direct_simulation() -> None:
    """_expected against collectives simulated with whole NumPy arrays."""
    n, per, dt = 3, 10, np.dtype(np.int32)
    op = ReduceOp.SUM
    idx = np.arange(n * per, dtype=np.int64)
    sends = [perf._values(r, idx, "sum", dt) for r in range(n)]
    datas = [perf._values(r, idx, "data", dt) for r in range(n)]
    total = np.asarray(np.sum(sends, axis=0, dtype=dt))
    for rank in range(n):
        def exp(coll: str, count: int, rank: int = rank) -> np.ndarray[Any, Any]:
            return perf._expected(coll, np.arange(count, dtype=np.int64), rank=rank,
                                  nranks=n, root=1, per=per, op=op, dtype=dt)
        assert np.array_equal(exp("all_reduce", n * per), total)
        assert np.array_equal(exp("reduce_scatter", per),
                              total[rank * per:(rank + 1) * per])
        assert np.array_equal(exp("broadcast", n * per), datas[1])
        assert np.array_equal(exp("all_gather", n * per),
                              np.concatenate([d[:per] for d in datas]))
        assert np.array_equal(exp("all_to_all", n * per),
                              np.concatenate([d[rank * per:(rank + 1) * per] for d in datas]))
        assert np.array_equal(exp("sendrecv", n * per), datas[(rank - 1) % n])
