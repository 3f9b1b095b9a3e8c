"""Results and their presentation: the table, the ``--vs`` comparison, JSON and plots.

:class:`Result` and :class:`Record` are the JSON schema (``--json``, ``bench/run_bench.py``
and the ranks' hand-over to the driver all read it): keep their fields stable.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import socket
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__

__all__ = ["PROG", "Record", "Result", "Table", "comparison", "human", "median_result",
           "report"]

PROG = "acoll-perf"


@dataclass
class Record:
    """One (size, mode) result: half a table row and one JSON record.

    ``time_us``, ``algbw`` and ``busbw`` are ``None`` for a mode not measured (N/A, with a
    ``note``); ``wrong`` is ``None`` when the output was not checked.
    """

    size: int
    count: int
    type: str
    redop: str
    root: int
    inplace: bool
    time_us: float | None
    algbw: float | None
    busbw: float | None
    wrong: int | None
    note: str = ""


@dataclass
class Result:
    """A whole sweep of one backend: its settings, records and notes."""

    backend: str
    settings: dict[str, Any]
    records: list[Record]
    notes: list[str]

    @property
    def wrong(self) -> int:
        return sum(r.wrong or 0 for r in self.records)

    @property
    def avg_busbw(self) -> float:
        vals = [r.busbw for r in self.records if r.busbw is not None]
        return sum(vals) / len(vals) if vals else 0.0

    def note(self, text: str) -> None:
        """Add a footer note once."""
        if text not in self.notes:
            self.notes.append(text)

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "settings": self.settings,
                "records": [asdict(r) for r in self.records], "notes": self.notes,
                "out_of_bounds": self.wrong, "avg_busbw": self.avg_busbw}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Result:
        return cls(data["backend"], data["settings"],
                   [Record(**r) for r in data["records"]], list(data["notes"]))

    @classmethod
    def load(cls, path: Path) -> Result | None:
        """The result a rank wrote to ``path``, or ``None`` if there is none readable."""
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


def median_result(rounds: list[Result]) -> Result:
    """One result from ``rounds`` of the same sweep: per (size, mode), the median time of
    the rounds that measured it (bandwidths follow from it) and the wrong elements of every
    round added up. Records are matched by (size, mode), never by position; a record that
    no round measured stays as the first round has it."""
    first = rounds[0]
    keyed = [{(x.size, x.inplace): x for x in r.records} for r in rounds]
    records = []
    for rec in first.records:
        key = (rec.size, rec.inplace)
        mine = [k[key] for k in keyed if key in k]
        measured = [x for x in mine if x.time_us is not None and x.algbw is not None
                    and x.busbw is not None]
        wrong = [x.wrong for x in mine if x.wrong is not None]
        if not measured:
            records.append(Record(rec.size, rec.count, rec.type, rec.redop, rec.root,
                                  rec.inplace, None, None, None,
                                  sum(wrong) if wrong else None, rec.note))
            continue
        ref = measured[0]  # (bandwidths scale with 1 / time)
        med = statistics.median([x.time_us or 0.0 for x in measured])
        scale = (ref.time_us or 0.0) / med if med > 0 else 1.0
        note = ref.note if len(measured) == len(rounds) else (
            f"measured in {len(measured)} of {len(rounds)} rounds")
        records.append(Record(rec.size, rec.count, rec.type, rec.redop, rec.root,
                              rec.inplace, med, (ref.algbw or 0.0) * scale,
                              (ref.busbw or 0.0) * scale, sum(wrong) if wrong else None, note))
    notes: list[str] = []
    for r in rounds:
        notes += [n for n in r.notes if n not in notes]
    return Result(first.backend, {**first.settings, "rounds": len(rounds)}, records, notes)


def round_ratios(mine: list[Result], peers: list[Result]) -> dict[tuple[int, bool], list[float]]:
    """Per (size, in place), acoll's busbw / the peer's in each round (paired by round)."""
    out: dict[tuple[int, bool], list[float]] = {}
    for m, p in zip(mine, peers, strict=True):
        for row in comparison(m, p):
            if row["busbw_ratio"] is not None:
                out.setdefault((row["size"], row["inplace"]), []).append(row["busbw_ratio"])
    return out


def human(nbytes: int) -> str:
    """``nbytes`` with a K/M/G suffix when it is a whole multiple of one."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def _fmt_time(us: float) -> str:
    return f"{us:7.0f}" if us >= 10000 else f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


class Table:
    """nccl-tests' table on stdout (rank 0 only) and an optional progress line on stderr."""

    def __init__(self, modes: int, progress: bool) -> None:
        self.modes = modes
        self.progress = progress
        self.shown = False

    def header(self, s: dict[str, Any]) -> None:
        """The header for a sweep with settings ``s`` (:attr:`Result.settings`)."""
        step = f"{s['stepbytes']}(bytes)" if s["stepbytes"] > 0 else f"{s['factor']:g}(factor)"
        print(f"# {PROG} {s['collective']}: minBytes {s['minbytes']} maxBytes {s['maxbytes']} "
              f"step: {step} warmup iters: {s['warmup']} iters: {s['iters']} "
              f"validation: {int(s['check'])}")
        print(f"# {s['backend']} | ranks {s['nranks']} | net {s['net']} | loop {s['loop']} "
              f"| chunk {s['chunk']} | host {s['host']} | time: {s['time_combine']} over "
              f"ranks")
        print("#")

        def cells(*v: str) -> str:
            return f"{v[0]:>12s}  {v[1]:>12s}  {v[2]:>8s}  {v[3]:>6s}  {v[4]:>6s}"

        def mode(*v: str) -> str:
            return f"  {v[0]:>7s}  {v[1]:>6s}  {v[2]:>6s}  {v[3]:>6s}"

        top = " " * 52
        cols = cells("size", "count", "type", "redop", "root")
        units = cells("(B)", "(elements)", "", "", "")
        for name in ("out-of-place", "in-place")[:self.modes]:
            top += f"{name:^33s}"
            cols += mode("time", "algbw", "busbw", "#wrong")
            units += mode("(us)", "(GB/s)", "(GB/s)", "")
        top, cols, units = ("#" + line[1:] for line in (top, cols, units))
        print(top.rstrip())
        print(cols)
        print(units.rstrip())
        sys.stdout.flush()

    def row(self, recs: Sequence[Record]) -> None:
        """One size: its records, out of place first."""
        self.clear()
        r0 = recs[0]
        line = f"{r0.size:12d}  {r0.count:12d}  {r0.type:>8s}  {r0.redop:>6s}  {r0.root:6d}"
        for r in recs:
            if r.time_us is None or r.algbw is None or r.busbw is None:
                line += f"  {'N/A':>7s}  {'N/A':>6s}  {'N/A':>6s}  {'N/A':>6s}"
                continue
            wrong = "N/A" if r.wrong is None else str(r.wrong)
            line += f"  {_fmt_time(r.time_us)}  {r.algbw:6.2f}  {r.busbw:6.2f}  {wrong:>6s}"
        print(line, flush=True)

    def footer(self, res: Result, checked: bool) -> None:
        self.clear()
        for note in res.notes:
            print(f"# note: {note}")
        status = ("OK" if res.wrong == 0 else "FAILED") if checked else "(not checked)"
        print(f"# Out of bounds values : {res.wrong} {status}")
        print(f"# Avg bus bandwidth    : {res.avg_busbw:.6g} ")
        print("#", flush=True)

    def step(self, done: int, total: int, what: str) -> None:
        """Progress: ``what`` is the ``done``-th of ``total`` sizes."""
        if self.progress:
            sys.stderr.write(f"\r\x1b[K# {PROG}: [{done}/{total}] {what}")
            sys.stderr.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


def _pairs(res: Result, peer: Result) -> list[tuple[Record, Record]]:
    """Matching records per size: in place where both measured it, else out of place."""
    def index(r: Result) -> dict[tuple[int, bool], Record]:
        return {(x.size, x.inplace): x for x in r.records if x.time_us is not None}

    mine, theirs = index(res), index(peer)
    out = []
    for size in sorted({x.size for x in res.records}):
        for inplace in (True, False):
            if (size, inplace) in mine and (size, inplace) in theirs:
                out.append((mine[size, inplace], theirs[size, inplace]))
                break
    return out


def comparison(res: Result, peer: Result) -> list[dict[str, Any]]:
    """The ``--vs`` rows (the JSON ``comparison``): acoll against ``peer`` per size."""
    rows = []
    for m, t in _pairs(res, peer):  # measured records only: times > 0, busbw set
        mt, tt, mb, tb = m.time_us or 1.0, t.time_us or 1.0, m.busbw or 0.0, t.busbw or 0.0
        rows.append({"size": m.size, "inplace": m.inplace, "acoll_time_us": mt,
                     "peer_time_us": tt, "acoll_busbw": mb, "peer_busbw": tb,
                     "busbw_ratio": mb / tb if tb > 0 else None, "time_ratio": tt / mt})
    return rows


def _print_comparison(rows: list[dict[str, Any]], name: str, rounds: int = 1) -> None:
    print(f"# acoll vs {name} (same sizes, dtype, op, ranks, iters; in-place where both "
          "support it)")
    if rounds > 1:
        print(f"# {rounds} rounds, {name} and acoll alternating: times are medians of the "
              "rounds; per round: acoll's busbw / its pair's, median (min..max)")
    print(f"#       size  mode   acoll(us)  {name:>5s}(us)  acoll_busbw  {name:>5s}_busbw  "
          f"busbw_ratio  time_ratio" + ("  per round" if rounds > 1 else ""))
    for r in rows:
        ratio = "N/A" if r["busbw_ratio"] is None else f"{r['busbw_ratio']:.2f}"
        per = r.get("round_ratios") or []
        tail = (f"  {statistics.median(per):.2f} ({min(per):.2f}..{max(per):.2f})"
                if per else "")
        if rounds > 1 and len(per) < rounds:  # (a mode N/A in some rounds on either side)
            tail += f" ({len(per)} of {rounds} rounds)"
        print(f"{r['size']:12d}  {'in ' if r['inplace'] else 'out'}  "
              f"{_fmt_time(r['acoll_time_us']):>10s}  {_fmt_time(r['peer_time_us']):>9s}  "
              f"{r['acoll_busbw']:11.3f}  {r['peer_busbw']:11.3f}  {ratio:>11s}  "
              f"{r['time_ratio']:10.2f}{tail}")
    ratios = [r["busbw_ratio"] for r in rows if r["busbw_ratio"] is not None]
    if ratios:
        geo = math.exp(sum(math.log(x) for x in ratios if x > 0) / len(ratios))
        print(f"# busbw ratio acoll/{name}: geometric mean {geo:.2f}, "
              f"min {min(ratios):.2f}, max {max(ratios):.2f}")
    print("#", flush=True)


def _print_medians(res: Result) -> None:
    rounds = int(res.settings.get("rounds", 1))
    print(f"# medians of {rounds} rounds")
    print("#       size  mode   time(us)  busbw(GB/s)")
    for r in res.records:
        if r.time_us is None or r.busbw is None:
            continue
        print(f"{r.size:12d}  {'in ' if r.inplace else 'out'}  {_fmt_time(r.time_us):>9s}  "
              f"{r.busbw:11.3f}{'  ' + r.note if r.note else ''}")
    print("#", flush=True)


def _machine() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__}


def report(res: Result, peer: Result | None, *, argv: Sequence[str], json_path: str | None,
           plot_path: str | None,
           per_round: dict[tuple[int, bool], list[float]] | None = None) -> None:
    """What the driver adds after the tables: the comparison, ``--json``, ``--plot``.

    ``argv`` is the command line (the JSON ``command`` and the plot's stamp); with
    ``--rounds``, ``res`` and ``peer`` are medians (:func:`median_result`) and
    ``per_round`` the rounds' own ratios (:func:`round_ratios`).
    """
    rows = None
    if peer is not None:
        rows = comparison(res, peer)
        if per_round is not None:
            for row in rows:
                row["round_ratios"] = per_round.get((row["size"], row["inplace"]), [])
        _print_comparison(rows, peer.backend, int(res.settings.get("rounds", 1)))
        if peer.wrong:
            print(f"# WARNING: {peer.backend}'s own results had {peer.wrong} wrong elements",
                  flush=True)
    elif int(res.settings.get("rounds", 1)) > 1:
        _print_medians(res)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    command = shlex.join([PROG, *argv])
    if json_path:
        doc = {"tool": PROG, "acoll_version": __version__, "machine": _machine(),
               "date": date, "command": command, **res.to_json(),
               "peer": None if peer is None else peer.to_json(), "comparison": rows}
        Path(json_path).write_text(json.dumps(doc, indent=1) + "\n")
    if plot_path:
        _plot(plot_path, res, peer, f"{command}  |  {date}")


def _plot(path: str, res: Result, peer: Result | None, stamp: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, lat) = plt.subplots(1, 2, figsize=(12, 5))
    for r in (res, peer):
        if r is None:
            continue
        for inplace in (False, True):
            pts = [x for x in r.records if x.inplace == inplace and x.busbw is not None
                   and x.time_us is not None and x.size > 0]
            if not pts:
                continue
            label = f"{r.backend} {'in-place' if inplace else 'out-of-place'}"
            style = {"marker": "o", "markersize": 3, "label": label,
                     "linestyle": "--" if inplace else "-"}
            ax.plot([x.size for x in pts], [x.busbw for x in pts], **style)
            lat.plot([x.size for x in pts], [x.time_us for x in pts], **style)
    s = res.settings
    fig.suptitle(f"{PROG} {s['collective']} {s['dtype']} {s['op']}, {s['nranks']} ranks, "
                 f"{s['host']} ({os.cpu_count()} CPUs)")
    for axis, name in ((ax, "busbw (GB/s)"), (lat, "time per op (us)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("size (bytes)")
        axis.set_ylabel(name)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    lat.set_yscale("log")
    fig.text(0.01, 0.01, stamp, fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120, metadata={"Description": stamp, "Software": PROG})
    plt.close(fig)
