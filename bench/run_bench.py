"""Run acoll's recorded benchmark set and write ``bench/results/`` (``make bench``).

Each benchmark is one ``acoll-perf`` command; for each, ``results/<name>.json`` (every record,
machine, date, command), ``<name>.txt`` (the printed tables, headed by machine, date and
command) and ``<name>.png`` (busbw and time against size) are written. ``summary.txt`` and
``summary.json`` then set acoll's 2-rank all_reduce busbw against raw loopback TCP (the
target: acoll busbw >= 60% of raw TCP) and against gloo.

Usage: ``python bench/run_bench.py [--quick] [--only NAME ...] [--out DIR]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TARGET = 0.60  # acoll busbw / raw TCP busbw

#: name -> acoll-perf arguments (without --json/--plot, added per run)
BENCHES: dict[str, list[str]] = {
    "all_reduce_2ranks": ["all_reduce", "-N", "2", "-b", "8", "-e", "256M", "-f", "2",
                          "-n", "20", "-w", "5", "-d", "float32", "-o", "sum", "--vs", "gloo"],
    "all_reduce_4ranks": ["all_reduce", "-N", "4", "-b", "8", "-e", "256M", "-f", "2",
                          "-n", "20", "-w", "5", "-d", "float32", "-o", "sum", "--vs", "gloo"],
    "tcp_2ranks": ["tcp", "-N", "2", "-b", "1M", "-e", "256M", "-f", "2", "-n", "20",
                   "-w", "5"],
}
#: --quick: the same set on small sizes, to check the pipeline in seconds
QUICK = {"-e": "1M", "-n": "3", "-w": "1"}


def _machine() -> str:
    return (f"{socket.gethostname()}, {os.cpu_count()} CPUs, {platform.platform()}, "
            f"Python {platform.python_version()}")


def _args(base: list[str], quick: bool) -> list[str]:
    args = list(base)
    if quick:
        for flag, value in QUICK.items():
            args[args.index(flag) + 1] = value
        if args[0] == "tcp":
            args[args.index("-b") + 1] = "64K"
    return args


def run_one(name: str, args: list[str], out: Path) -> dict[str, Any]:
    """Run one benchmark; write its .txt/.json/.png; return its JSON document."""
    json_path, png_path, txt_path = (out / f"{name}.{ext}" for ext in ("json", "png", "txt"))
    args = [*args, "--json", os.path.relpath(json_path), "--plot", os.path.relpath(png_path),
            "--no-progress"]
    command = shlex.join(["acoll-perf", *args])
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"== {name}: {command}", flush=True)
    proc = subprocess.run([sys.executable, "-m", "acoll.perf", *args], stdout=subprocess.PIPE,
                          text=True, check=False)
    sys.stdout.write(proc.stdout)
    txt_path.write_text(f"# command: {command}\n# machine: {_machine()}\n# date: {date}\n"
                        f"# exit code: {proc.returncode}\n{proc.stdout}")
    if proc.returncode != 0:
        raise SystemExit(f"{name}: acoll-perf exited with {proc.returncode}")
    doc: dict[str, Any] = json.loads(json_path.read_text())
    return doc


def _busbw(doc: dict[str, Any], inplace: bool | None = None) -> dict[int, float]:
    """Best busbw per size (over modes, unless ``inplace`` picks one)."""
    best: dict[int, float] = {}
    for r in doc["records"]:
        if r["busbw"] is None or (inplace is not None and r["inplace"] != inplace):
            continue
        best[r["size"]] = max(best.get(r["size"], 0.0), r["busbw"])
    return best


def summarize(docs: dict[str, dict[str, Any]], out: Path) -> None:
    """Write summary.txt/.json: acoll vs raw TCP (the 60% target) and acoll vs gloo."""
    lines = [f"# acoll benchmark summary  |  {_machine()}  |  "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}"]
    summary: dict[str, Any] = {"machine": _machine(), "target": TARGET}
    ar2, tcp = docs.get("all_reduce_2ranks"), docs.get("tcp_2ranks")
    if ar2 is not None and tcp is not None:
        acoll_bw, tcp_bw = _busbw(ar2, inplace=False), _busbw(tcp)
        common = sorted(set(acoll_bw) & set(tcp_bw))
        rows: list[dict[str, Any]] = [
            {"size": s, "acoll_busbw": acoll_bw[s], "tcp_busbw": tcp_bw[s],
             "fraction": acoll_bw[s] / tcp_bw[s] if tcp_bw[s] else None} for s in common]
        summary["vs_tcp"] = rows
        lines += ["", "# 2-rank all_reduce (out-of-place) busbw vs raw TCP ring exchange "
                  f"(target >= {TARGET:.0%})",
                  f"# {'size':>10s}  {'acoll GB/s':>10s}  {'tcp GB/s':>10s}  {'acoll/tcp':>9s}"]
        for r in rows:
            frac = "N/A" if r["fraction"] is None else f"{r['fraction']:.0%}"
            lines.append(f"{r['size']:12d}  {r['acoll_busbw']:10.3f}  {r['tcp_busbw']:10.3f}  "
                         f"{frac:>9s}")
        if rows:
            peak_a = max(acoll_bw[s] for s in common)
            peak_t = max(tcp_bw[s] for s in common)
            lines.append(f"# peak: acoll {peak_a:.3f} GB/s, tcp {peak_t:.3f} GB/s "
                         f"({peak_a / peak_t:.0%}; target {TARGET:.0%}: "
                         f"{'met' if peak_a >= TARGET * peak_t else 'NOT met'})")
            summary["peak"] = {"acoll": peak_a, "tcp": peak_t}
    for name, doc in docs.items():
        comp = doc.get("comparison")
        if not comp:
            continue
        summary[f"{name}_vs_{doc['peer']['backend']}"] = comp
        lines += ["", f"# {name}: acoll vs {doc['peer']['backend']} ({doc['command']})",
                  f"# {'size':>10s}  {'acoll us':>10s}  {'peer us':>10s}  {'acoll GB/s':>10s}  "
                  f"{'peer GB/s':>10s}  {'bw ratio':>8s}"]
        for r in comp:
            ratio = "N/A" if r["busbw_ratio"] is None else f"{r['busbw_ratio']:.2f}"
            lines.append(f"{r['size']:12d}  {r['acoll_time_us']:10.1f}  "
                         f"{r['peer_time_us']:10.1f}  {r['acoll_busbw']:10.3f}  "
                         f"{r['peer_busbw']:10.3f}  {ratio:>8s}")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark set (or ``--only`` some of it) and write the results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few iterations")
    p.add_argument("--only", nargs="+", choices=sorted(BENCHES), help="run these only")
    p.add_argument("--out", type=Path, default=HERE / "results", help="results directory")
    ns = p.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("run_bench: the gloo comparison needs PyTorch: pip install 'torch==2.13.0' "
              "(make bench does it)", file=sys.stderr)
        return 2
    ns.out.mkdir(parents=True, exist_ok=True)
    docs = {name: run_one(name, _args(args, ns.quick), ns.out)
            for name, args in BENCHES.items() if not ns.only or name in ns.only}
    summarize(docs, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
