"""acoll and Gloo all_reduce across "hosts" joined by rate-limited links (needs root).

Each host is a network namespace with one interface, ``eth0``, joined by a veth pair to a
bridge in a switch namespace; every link is shaped with ``tc ... tbf`` to ``--rate`` in both
directions (the host's ``eth0`` egress, and the switch port's egress toward the host), like
a full-duplex NIC port::

    acollb<pid>h0  eth0 10.78.0.1/24 ==tbf== vh0 --.
    acollb<pid>h1  eth0 10.78.0.2/24 ==tbf== vh1 ---+-- br0   (namespace acollb<pid>sw)
    ...                                             |
    acollb<pid>h3  eth0 10.78.0.4/24 ==tbf== vh3 --'

Only 10.78.0.0/24 is used, only inside these namespaces; nothing is added to the root
namespace. Everything is removed on exit, on errors and on Ctrl-C/SIGTERM/SIGHUP (the
namespaces take their veths, bridge and qdiscs with them); namespaces that a killed run left
(``acollb<pid>*`` of a dead pid) are removed at the next start.

One rank per host runs ``acoll-perf all_reduce`` (the same sweep, timing and check as
``acoll-perf``; in-place results) with ``ACOLL_SOCKET_IFNAME==eth0`` and the shared-memory
and in-process transports off, then Gloo (``torch.distributed``) on the same hosts and links.
busbw is reported against the line rate: for all_reduce, busbw is what each link carries per
direction, so 100% is the link's rate.

Every veth end steers its received packets by flow to one CPU (RPS over all CPUs), as a
real NIC's receive-side scaling keeps a flow on one queue. Without it a veth hands each
packet to the backlog of whichever CPU sent it (the one that ran the tbf at that moment),
CPUs drain their backlogs independently, and a flow's packets arrive out of order: TCP
then retransmits data that was never lost (measured: 800 to 1,100 retransmitted segments
and about 100 out-of-order queueings a run with 4 hosts at 4 Gbit/s on 2 CPUs, every
packet sent delivered; with RPS 8 and 0). ``--no-rps`` keeps the old behaviour.

    python bench/netns_shaped.py --rate 10gbit -b 1M -e 256M --out bench/results/x.txt
    python bench/netns_shaped.py --check      # set up, time one TCP stream, tear down
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import platform
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "acollb"
SUBNET = "10.78.0"
CMD_TIMEOUT = 20.0
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)(sw|h\d+)$")
_TRACE_RE = re.compile(r"^acoll-netns-(\d+)$")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?$", re.IGNORECASE)
_STATS_RE = re.compile(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+), overlimits (\d+)")
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def cpu_mask(cpus: int | None = None) -> str:
    """A Linux CPU bitmap of the first ``cpus`` CPUs (all by default): hex, a comma between
    32-bit words, as ``rps_cpus`` takes it (``ff``, ``ffffffff,ffffffff``)."""
    n = (os.cpu_count() or 1) if cpus is None else cpus
    if n < 1:
        raise ValueError(f"cpus must be >= 1, not {n}")
    text = format((1 << n) - 1, "x")
    words = []
    while text:
        words.append(text[-8:])
        text = text[:-8]
    return ",".join(reversed(words))


def rate_bits(text: str) -> float:
    """Bits per second of a tc rate (``10gbit``, ``500mbit``, ``1.25gbps`` = bytes/s)."""
    m = _RATE_RE.match(text.strip())
    if m is None:
        raise ValueError(f"not a tc rate: {text!r} (e.g. 10gbit, 2500mbit)")
    value = float(m.group(1)) * _SCALE[m.group(2).lower()]
    return value * 8 if (m.group(3) or "").lower() == "bps" else value


def sh(*args: str, timeout: float = CMD_TIMEOUT, check: bool = True) -> str:
    """Run one command (no shell); its stdout. Raises RuntimeError with stderr on failure."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)} failed ({proc.returncode}): "
                           f"{proc.stderr.strip()}")
    return proc.stdout


def namespaces() -> list[str]:
    """Every network namespace ``ip netns`` knows."""
    return [ln.split()[0] for ln in sh("ip", "netns", "list", check=False).splitlines()
            if ln.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone; their names."""
    gone = []
    for name in namespaces():
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            sh("ip", "netns", "del", name, check=False)
            gone.append(name)
    for root in TRACEFS:  # drop-trace instances of runs killed before they removed them
        with contextlib.suppress(OSError):
            for inst in (root / "instances").iterdir():
                m = _TRACE_RE.match(inst.name)
                if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
                    with contextlib.suppress(OSError):
                        (inst / "events" / "skb" / "kfree_skb" / "enable").write_text("0")
                    with contextlib.suppress(OSError):
                        inst.rmdir()
                        gone.append(f"tracefs instance {inst.name}")
    return gone


#: TCP counters a run reports (``Tcp:`` and ``TcpExt:`` lines): segments sent, and the
#: signs of loss (retransmits, timeouts, tail-loss probes) and of a receiver falling behind.
#: (TCPDSACKRecv: retransmits the receiver already had, spurious, as reordering causes;
#: TCPSACKReorder: reordering seen; TCPOFOQueue: segments that arrived out of order.)
TCP_COUNTERS = ("OutSegs", "RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPFastRetrans",
                "TCPDSACKRecv", "TCPSACKReorder", "TCPOFOQueue", "TCPRcvQDrop",
                "TCPBacklogDrop")


def parse_counters(text: str) -> dict[str, int]:
    """``{name: value}`` from ``/proc/net/snmp``-style text (a line of names, then a line
    of values, both starting with the same ``Group:``)."""
    out: dict[str, int] = {}
    lines = text.splitlines()
    for names, values in itertools.pairwise(lines):
        head, _, rest = names.partition(":")
        vhead, _, vrest = values.partition(":")
        if not head or head != vhead or not rest.split() or rest.split()[0].lstrip(
                "-").isdigit():
            continue
        for name, value in zip(rest.split(), vrest.split(), strict=False):
            with contextlib.suppress(ValueError):
                out[name] = int(value)
    return out


@dataclass
class Topology:
    """``hosts`` namespaces on one bridge, each link shaped by tbf (see the module docstring).

    ``burst`` and ``limit`` are tbf's (tc syntax): the bytes that may leave at once after an
    idle spell, and the queue in bytes before tail drop.
    """

    hosts: int = 4
    rate: str = "10gbit"
    burst: str = "256kb"
    limit: str = "4mb"
    rps: bool = True  # steer each veth's received packets by flow (see the module docstring)
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    created: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.tag}sw"

    def host(self, i: int) -> str:
        return f"{self.tag}h{i}"

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def _tbf(self, ns: str, dev: str) -> None:
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
           "burst", self.burst, "limit", self.limit)

    @staticmethod
    def _steer(ns: str, dev: str) -> None:
        """RPS over every CPU for ``dev``'s receive queue (``ip netns exec`` gives the
        command the namespace's own /sys)."""
        path = f"/sys/class/net/{dev}/queues/rx-0/rps_cpus"
        sh("ip", "netns", "exec", ns, "sh", "-c", f"echo {cpu_mask()} > {path}")

    def steering(self) -> list[str]:
        """Each veth end's RPS mask, as ``namespace/dev=mask``."""
        out = []
        for i in range(self.hosts):
            for ns, dev in ((self.host(i), "eth0"), (self.switch, f"vh{i}")):
                mask = sh("ip", "netns", "exec", ns, "cat",
                          f"/sys/class/net/{dev}/queues/rx-0/rps_cpus", check=False)
                out.append(f"{ns}/{dev}={mask.strip()}")
        return out

    def _add_ns(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self.created.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
           check=False)

    def create(self) -> None:
        """Build it; on failure, remove what was built and raise."""
        if not 1 <= self.hosts <= 200:
            raise ValueError(f"hosts must be 1..200, not {self.hosts}")
        try:
            self._add_ns(self.switch)
            sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.hosts):
                ns, port = self.host(i), f"vh{i}"
                self._add_ns(ns)
                sh("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer",
                   "name", "eth0", "netns", ns)
                sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                sh("ip", "-n", self.switch, "link", "set", port, "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
                self._tbf(ns, "eth0")  # host -> switch
                self._tbf(self.switch, port)  # switch -> host
                if self.rps:
                    self._steer(ns, "eth0")
                    self._steer(self.switch, port)
            self._wait_forwarding()
        except BaseException:
            self.destroy()
            raise

    def _wait_forwarding(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = sh("bridge", "-n", self.switch, "link", "show", check=False)
            if out.count("state forwarding") >= self.hosts:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"bridge ports not forwarding after {timeout:g} s:\n{out}")
            time.sleep(0.05)

    def destroy(self) -> None:
        """Delete every namespace made (their veths, bridge and qdiscs go with them)."""
        for ns in reversed(self.created):
            sh("ip", "netns", "del", ns, check=False)
        self.created.clear()

    def leftovers(self) -> list[str]:
        """Namespaces of this topology that still exist."""
        return [n for n in namespaces() if n.startswith(self.tag)]

    def tbf_counters(self) -> tuple[int, int, int]:
        """Bytes sent, packets dropped and overlimits, summed over every tbf."""
        total = [0, 0, 0]
        for i in range(self.hosts):
            for ns, dev in ((self.host(i), "eth0"), (self.switch, f"vh{i}")):
                text = sh("tc", "-n", ns, "-s", "qdisc", "show", "dev", dev, check=False)
                m = _STATS_RE.search(text)
                if m:
                    for k in range(3):
                        total[k] += int(m.group(k + 1))
        return total[0], total[1], total[2]

    def _link_packets(self, ns: str, dev: str) -> tuple[int, int]:
        """(received, sent) packets of one veth end, from ``ip -s -j link``."""
        text = sh("ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev, check=False)
        try:
            stats = json.loads(text)[0]["stats64"]
            return int(stats["rx"]["packets"]), int(stats["tx"]["packets"])
        except (ValueError, LookupError, TypeError):
            return -1, -1

    def link_packets(self) -> tuple[int, int]:
        """Packets the veth ends sent and those their peers received, summed over every
        link and direction (a veth packet may be a TCP segmentation-offload burst): a gap
        means packets lost between the two ends of a link."""
        sent = received = 0
        for i in range(self.hosts):
            h_rx, h_tx = self._link_packets(self.host(i), "eth0")
            s_rx, s_tx = self._link_packets(self.switch, f"vh{i}")
            sent += h_tx + s_tx
            received += s_rx + h_rx
        return sent, received

    def tcp_counters(self) -> dict[str, int]:
        """TCP's counters of :data:`TCP_COUNTERS`, summed over the hosts' namespaces (from
        their ``/proc/net/snmp`` and ``/proc/net/netstat``)."""
        total = dict.fromkeys(TCP_COUNTERS, 0)
        for i in range(self.hosts):
            text = sh("ip", "netns", "exec", self.host(i), "cat", "/proc/net/snmp",
                      "/proc/net/netstat", check=False)
            for name, value in parse_counters(text).items():
                if name in total:
                    total[name] += value
        return total

    @staticmethod
    def softnet_drops() -> int:
        """Packets the machine's CPUs dropped from their input backlogs (all namespaces:
        ``/proc/net/softnet_stat``'s second column), e.g. a veth's receive side."""
        try:
            rows = Path("/proc/net/softnet_stat").read_text().split("\n")
        except OSError:
            return -1
        return sum(int(r.split()[1], 16) for r in rows if len(r.split()) > 1)


#: Where tracefs may be, in order (mounted there at the first use if it is not yet).
TRACEFS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
_DROP_RE = re.compile(r"location=(?:0x)?([A-Za-z0-9_.]+)\S* reason: (\w+)")


def parse_drops(text: str) -> dict[str, int]:
    """``{"REASON at function": count}`` from ``skb:kfree_skb`` trace lines (each freed
    packet the kernel calls dropped names a reason and the function that dropped it)."""
    out: dict[str, int] = {}
    for m in _DROP_RE.finditer(text):
        key = f"{m.group(2)} at {m.group(1)}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


class DropTrace:
    """Every packet the kernel drops during a run, by reason and place: the ``skb:kfree_skb``
    tracepoint (Linux >= 5.17 names a reason) in a tracefs instance of its own, so that it
    neither sees nor disturbs other tracing. Machine-wide (every namespace): the namespaces
    of the topology carry nearly all the packets of a run.

    ``start()`` returns an error text instead of raising when tracing is unavailable.
    """

    def __init__(self, buffer_kb: int = 16384) -> None:
        self.buffer_kb = buffer_kb
        self.dir: Path | None = None

    @staticmethod
    def _root() -> Path:
        for root in TRACEFS:
            if (root / "instances").is_dir():
                return root
        root = TRACEFS[0]
        sh("mount", "-t", "tracefs", "nodev", str(root))
        if not (root / "instances").is_dir():
            raise OSError(f"no tracefs instances under {root}")
        return root

    def start(self) -> str | None:
        try:
            inst = self._root() / "instances" / f"acoll-netns-{os.getpid()}"
            if not inst.exists():
                inst.mkdir()
            self.dir = inst
            event = inst / "events" / "skb" / "kfree_skb"
            if not (event / "enable").exists():
                raise OSError("this kernel has no skb:kfree_skb tracepoint")
            (inst / "buffer_size_kb").write_text(str(self.buffer_kb))
            (inst / "trace").write_text("")
            (event / "enable").write_text("1")
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            self.close()
            return f"drop trace unavailable: {exc}"
        return None

    def stop(self) -> tuple[dict[str, int], int]:
        """(drops by reason and place, events the buffer overwrote) since :meth:`start`."""
        if self.dir is None:
            return {}, 0
        with contextlib.suppress(OSError):
            (self.dir / "events" / "skb" / "kfree_skb" / "enable").write_text("0")
        text = ""
        with contextlib.suppress(OSError):
            text = (self.dir / "trace").read_text(errors="replace")
        lost = 0
        with contextlib.suppress(OSError, ValueError):
            for cpu in (self.dir / "per_cpu").iterdir():
                for line in (cpu / "stats").read_text().splitlines():
                    if line.startswith("overrun:"):
                        lost += int(line.split()[1])
        return parse_drops(text), lost

    def close(self) -> None:
        if self.dir is not None:
            with contextlib.suppress(OSError):
                (self.dir / "events" / "skb" / "kfree_skb" / "enable").write_text("0")
            with contextlib.suppress(OSError):
                self.dir.rmdir()
            self.dir = None


@contextlib.contextmanager
def topology(topo: Topology) -> Iterator[Topology]:
    """``topo`` built, and removed however the block ends (signals included)."""
    def stop(sig: int, _frame: Any) -> None:
        raise SystemExit(128 + sig)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        topo.create()
        yield topo
    finally:
        # no second Ctrl-C in the middle of the teardown
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM,
                                                  signal.SIGHUP})
        try:
            topo.destroy()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM,
                                                        signal.SIGHUP})


# --------------------------------------------------------------------------- processes

class Group:
    """Processes started in namespaces, each in its own session; :meth:`kill` ends them all."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, ns: str, argv: Sequence[str], env: dict[str, str], out: Path,
              ) -> subprocess.Popen[bytes]:
        with out.open("wb") as f:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env,
                                    stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait(self, timeout: float) -> list[int] | None:
        """Exit codes, or ``None`` if some process was still running at the deadline."""
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                return None
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=CMD_TIMEOUT)


def _cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    f = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + (f[4] if len(f) > 4 else 0.0)  # idle + iowait
    return sum(f) - idle, sum(f)


@dataclass
class Run:
    """One library's sweep: rank 0's result, its table, and what it cost."""

    lib: str
    result: dict[str, Any] | None
    table: str
    codes: list[int] | None
    wall_s: float
    cpu_user_s: float
    cpu_sys_s: float
    busy: float  # fraction of all CPUs busy (anything on the machine), over the run
    tbf: tuple[int, int, int]  # bytes sent, drops, overlimits of every tbf during the run
    tcp: dict[str, int] = field(default_factory=dict)  # TCP_COUNTERS' growth over the run
    drops: str = ""  # with --trace-drops: the kernel's dropped packets by reason and place

    @property
    def ok(self) -> bool:
        return self.result is not None and self.codes is not None and not any(self.codes)


def run_library(topo: Topology, lib: str, sweep: Sequence[str], extra_env: dict[str, str],
                timeout: float, port: int, profile: Path | None = None,
                trace_drops: bool = False) -> Run:
    """One rank per host: ``acoll-perf all_reduce`` with acoll (``lib == "acoll"``) or gloo.

    ``profile``: a folder; each rank then runs under cProfile, writing
    ``<lib>-rank<i>.prof`` there. ``trace_drops``: count the kernel's dropped packets by
    reason over the run (:class:`DropTrace`).
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ACOLL_", "GLOO_"))}
    secret = os.urandom(32).hex()
    group = Group()
    with tempfile.TemporaryDirectory(prefix="acoll-netns-") as tmp:
        result_file = Path(tmp, "rank0.json")
        q0, k0, d0 = topo.tbf_counters(), topo.tcp_counters(), topo.softnet_drops()
        p0 = topo.link_packets()
        tracer = DropTrace() if trace_drops else None
        trace_error = tracer.start() if tracer is not None else None
        t0, r0, c0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN), \
            _cpu_busy()
        try:
            for i in range(topo.hosts):
                env = dict(base, ACOLL_RANK=str(i), ACOLL_WORLD_SIZE=str(topo.hosts),
                           ACOLL_LOCAL_RANK="0", ACOLL_LOCAL_SIZE="1",
                           ACOLL_COMM_ID=f"{topo.address(0)}:{port}", ACOLL_COMM_SECRET=secret,
                           ACOLL_SOCKET_IFNAME="=eth0", ACOLL_SHM_DISABLE="1",
                           ACOLL_INPROC_DISABLE="1", ACOLL_TIMEOUT=str(int(timeout)),
                           GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1")
                if lib == "acoll":
                    env.update(extra_env)
                prof = [] if profile is None else [
                    "-m", "cProfile", "-o", str(profile / f"{lib}-rank{i}.prof")]
                argv = [sys.executable, *prof, "-m", "acoll.perf", "all_reduce", *sweep,
                        "--no-progress", "--result-file", str(result_file)]
                if lib != "acoll":
                    argv += ["--backend", lib, "--peer-init",
                             f"tcp://{topo.address(0)}:{port + 1}"]
                group.start(topo.host(i), argv, env, Path(tmp, f"rank{i}.out"))
            codes = group.wait(timeout)
        finally:
            group.kill()
            dropped, overrun = tracer.stop() if tracer is not None else ({}, 0)
            if tracer is not None:
                tracer.close()
        c1, r1 = _cpu_busy(), resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.monotonic() - t0
        outs = [Path(tmp, f"rank{i}.out").read_text(errors="replace")
                for i in range(topo.hosts)]
        result = json.loads(result_file.read_text()) if result_file.exists() else None
    table = outs[0]
    if codes is None or any(codes) or result is None:
        table += "".join(f"\n--- rank {i} output\n{o}" for i, o in enumerate(outs[1:], 1)
                         if o.strip())
        if codes is None:
            table += f"\n--- stopped: still running after {timeout:g} s"
    q1, k1, d1 = topo.tbf_counters(), topo.tcp_counters(), topo.softnet_drops()
    p1 = topo.link_packets()
    drops = ""
    if tracer is not None:
        drops = trace_error or (", ".join(f"{k} {v}" for k, v in dropped.items()) or "none")
        if overrun:
            drops += f" (and {overrun} events the trace buffer lost)"
    return Run(lib, result, table, codes, wall, r1.ru_utime - r0.ru_utime,
               r1.ru_stime - r0.ru_stime, (c1[0] - c0[0]) / max(c1[1] - c0[1], 1.0),
               (q1[0] - q0[0], q1[1] - q0[1], q1[2] - q0[2]),
               {**{k: k1[k] - k0[k] for k in k1}, "softnet drops": d1 - d0,
                "link packets sent": p1[0] - p0[0],
                "not received": (p1[0] - p0[0]) - (p1[1] - p0[1])}, drops)


# --------------------------------------------------------------------------- report

def busbw_by_size(result: dict[str, Any]) -> dict[int, float]:
    """In-place busbw (GB/s) per size of an acoll-perf result (out of place if no in-place)."""
    got: dict[int, float] = {}
    for inplace in (False, True):
        for r in result["records"]:
            if r["inplace"] == inplace and r["busbw"] is not None:
                got[r["size"]] = r["busbw"]
    return got


def summary(runs: Sequence[Run], line_gbs: float, target_from: int = 16 << 20,
            target_frac: float = 0.9) -> str:
    """The table of busbw against the line rate, and the issue's target per size.

    With several runs of a library, each size's best busbw counts (other load on the
    machine only ever slows a run down).
    """
    by: dict[str, dict[int, float]] = {}
    for r in runs:
        if r.result is not None:
            best = by.setdefault(r.lib, {})
            for size, bw in busbw_by_size(r.result).items():
                best[size] = max(bw, best.get(size, 0.0))
    sizes = sorted({s for v in by.values() for s in v})
    libs = list(by)
    repeats = max(sum(1 for r in runs if r.lib == lib) for lib in libs) if libs else 1
    head = "#        size" + "".join(f"  {lib + '_busbw':>12s}  {lib + '_%line':>11s}"
                                    for lib in libs)
    if {"acoll", "gloo"} <= set(libs):
        head += "  acoll/gloo"
    best = f", best of {repeats} runs" if repeats > 1 else ""
    lines = [f"# busbw (GB/s, in place{best}) against the line rate {line_gbs:.3f} GB/s "
             "per direction", head]
    missed = []
    for size in sizes:
        row = f"{size:13d}"
        for lib in libs:
            bw = by[lib].get(size)
            row += (f"  {bw:12.3f}  {100 * bw / line_gbs:10.1f}%" if bw is not None
                    else f"  {'N/A':>12s}  {'N/A':>11s}")
        a, g = by.get("acoll", {}).get(size), by.get("gloo", {}).get(size)
        if a is not None and g is not None and g > 0:
            row += f"  {a / g:10.2f}"
        lines.append(row)
        if size >= target_from and a is not None and (
                a < target_frac * line_gbs or (g is not None and a < g)):
            missed.append(size)
    big = [s for s in sizes if s >= target_from and "acoll" in by]
    if big:
        verdict = ("met" if not missed else
                   "missed at " + ", ".join(f"{s >> 20}M" for s in missed))
        lines.append(f"# target (acoll busbw >= {target_frac:.0%} of the line rate and >= "
                     f"gloo at >= {target_from >> 20}M): {verdict}")
    seen: dict[str, int] = {}
    for r in runs:
        cpu = r.cpu_user_s + r.cpu_sys_s
        seen[r.lib] = seen.get(r.lib, 0) + 1
        name = r.lib if repeats == 1 else f"{r.lib} run {seen[r.lib]}"
        lines.append(f"# {name}: wall {r.wall_s:.1f} s, ranks' CPU {cpu:.1f} s (user "
                     f"{r.cpu_user_s:.1f}, sys {r.cpu_sys_s:.1f}) = {cpu / r.wall_s:.2f} "
                     f"cores; all CPUs {100 * r.busy:.0f}% busy; tbf: {r.tbf[0] / 1e6:.0f} "
                     f"MB through, {r.tbf[1]} packets dropped, {r.tbf[2]} overlimits")
        if r.tcp:
            lines.append(f"#   {name} TCP: " + ", ".join(f"{k} {v}" for k, v in r.tcp.items()))
        if r.drops:
            lines.append(f"#   {name} packets the kernel dropped: {r.drops}")
    return "\n".join(lines)


def check_stream(topo: Topology, seconds: float = 2.0) -> float:
    """Gbit/s of one TCP stream from host 0 to host 1 over ``seconds``."""
    server = ("import socket, sys, time\n"
              "s = socket.create_server((sys.argv[1], 29399)); s.settimeout(20)\n"
              "print('listening', flush=True)\n"
              "c, _ = s.accept(); c.settimeout(20); n = 0; buf = bytearray(1 << 20)\n"
              "t0 = None\n"
              "while True:\n"
              "    k = c.recv_into(buf)\n"
              "    if not k: break\n"
              "    if t0 is None: t0 = time.monotonic()\n"
              "    n += k\n"
              "print(n * 8 / (time.monotonic() - t0) / 1e9, flush=True)\n")
    client = ("import socket, sys, time\n"
              "c = socket.create_connection((sys.argv[1], 29399), timeout=20)\n"
              "buf = bytes(1 << 20); end = time.monotonic() + float(sys.argv[2])\n"
              "while time.monotonic() < end: c.sendall(buf)\n"
              "c.close()\n")
    srv = subprocess.Popen(["ip", "netns", "exec", topo.host(1), sys.executable, "-c", server,
                            topo.address(1)], stdout=subprocess.PIPE, text=True,
                           stdin=subprocess.DEVNULL)
    try:
        assert srv.stdout is not None
        if srv.stdout.readline().strip() != "listening":
            raise RuntimeError("the check's server did not start")
        subprocess.run(["ip", "netns", "exec", topo.host(0), sys.executable, "-c", client,
                        topo.address(1), str(seconds)], check=True, timeout=seconds + 30,
                       stdin=subprocess.DEVNULL)
        out, _ = srv.communicate(timeout=30)
        return float(out.strip().splitlines()[-1])
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def _machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (f"{platform.node()}, {os.cpu_count()} CPUs ({model}), Linux {platform.release()}, "
            f"Python {platform.python_version()}")


def _versions() -> str:
    from acoll import __version__

    text = f"acoll {__version__}"
    with contextlib.suppress(ImportError):
        import torch

        text += f", torch {torch.__version__}"
    return text


# --------------------------------------------------------------------------- command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="10gbit", help="link rate, tc syntax (10gbit)")
    p.add_argument("--burst", default="256kb",
                   help="tbf burst, tc syntax (256kb: 0.2 ms at 10 Gbit/s)")
    p.add_argument("--limit", default="4mb",
                   help="tbf queue limit in bytes, tc syntax (4mb: 3.4 ms at 10 Gbit/s)")
    p.add_argument("--hosts", type=int, default=4, help="hosts (namespaces), one rank each")
    p.add_argument("--no-rps", action="store_true",
                   help="leave the veths' receive steering off (packets of a flow then "
                        "reach TCP out of order; see the module docstring)")
    p.add_argument("--libs", default="acoll,gloo", help="comma list of acoll, gloo")
    p.add_argument("-b", "--minbytes", default="1M")
    p.add_argument("-e", "--maxbytes", default="256M")
    p.add_argument("-f", "--stepfactor", default="2")
    p.add_argument("-n", "--iters", default="10")
    p.add_argument("-w", "--warmup_iters", default="3")
    p.add_argument("--no-check", action="store_true",
                   help="skip acoll-perf's result check (-c 0): the ranks' CPU is then "
                        "mostly the collective's own")
    p.add_argument("--acoll-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an ACOLL_* setting for acoll's ranks (repeatable), e.g. "
                        "ACOLL_SOCKET_NSOCKS=4")
    p.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="run the libraries R times, alternating; the summary takes each "
                        "size's best (damps other load on a shared machine)")
    p.add_argument("--profile", metavar="DIR",
                   help="run every rank under cProfile, writing DIR/<lib>-rank<i>.prof")
    p.add_argument("--trace-drops", action="store_true",
                   help="count every packet the kernel drops during each run, by reason "
                        "and function (tracefs, skb:kfree_skb)")
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds one library's sweep may take (1200)")
    p.add_argument("--out", help="also write the report (with date, machine, command) here")
    p.add_argument("--check", action="store_true",
                   help="only set up, time one TCP stream host 0 -> host 1, tear down")
    p.add_argument("--hold", type=float, default=0.0, metavar="S",
                   help="with --check: after the stream, keep the topology S seconds "
                        "(teardown tests)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if os.geteuid() != 0:
        print("netns_shaped: needs root (ip netns add, tc)", file=sys.stderr)
        return 2
    try:
        line_gbs = rate_bits(args.rate) / 8 / 1e9
    except ValueError as exc:
        print(f"netns_shaped: --rate: {exc}", file=sys.stderr)
        return 2
    libs = [x for x in args.libs.split(",") if x]
    if not set(libs) <= {"acoll", "gloo"}:
        print(f"netns_shaped: --libs takes acoll and gloo, not {args.libs!r}", file=sys.stderr)
        return 2
    if "gloo" in libs and not args.check:
        try:
            import torch.distributed as dist

            if not dist.is_gloo_available():
                raise ImportError("this torch build has no gloo")
        except ImportError as exc:
            print(f"netns_shaped: gloo needs torch ({exc}): pip install 'acoll[bench]'",
                  file=sys.stderr)
            return 2
    extra = {}
    for item in args.acoll_env:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("ACOLL_"):
            print(f"netns_shaped: --acoll-env wants ACOLL_NAME=VALUE, not {item!r}",
                  file=sys.stderr)
            return 2
        extra[name] = value
    stale = cleanup_stale()
    if stale:
        print(f"# removed namespaces of earlier runs: {' '.join(stale)}", file=sys.stderr)
    topo = Topology(args.hosts, args.rate, args.burst, args.limit, rps=not args.no_rps)
    sweep = ["-b", args.minbytes, "-e", args.maxbytes, "-f", args.stepfactor,
             "-n", args.iters, "-w", args.warmup_iters, *(["-c", "0"] if args.no_check else [])]
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    command = shlex.join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None
                                                          else argv)])
    header = [f"# {command}", f"# date {date}", f"# machine {_machine()}",
              f"# {_versions()}",
              f"# {topo.hosts} hosts (network namespaces) on one bridge; every link tbf "
              f"rate {topo.rate} burst {topo.burst} limit {topo.limit}, both directions; "
              + (f"receive steering (RPS) of every veth end over CPUs {cpu_mask()}"
                 if topo.rps else "no receive steering (--no-rps)"),
              f"# acoll: ACOLL_SOCKET_IFNAME==eth0 ACOLL_SHM_DISABLE=1 "
              f"ACOLL_INPROC_DISABLE=1 {' '.join(f'{k}={v}' for k, v in extra.items())}"
              .rstrip(), "# gloo: torch.distributed gloo, GLOO_SOCKET_IFNAME=eth0"]
    if topo.hosts > (os.cpu_count() or 1):
        header.append(f"# note: {topo.hosts} ranks share {os.cpu_count()} CPUs (and the "
                      "kernel's veth/bridge/tbf work runs on the same CPUs)")
    with topology(topo):
        if args.check:
            gbit = check_stream(topo)
            print(f"ready: {topo.hosts} hosts; one TCP stream host 0 -> host 1: "
                  f"{gbit:.2f} Gbit/s ({100 * gbit / (line_gbs * 8):.0f}% of {topo.rate})",
                  flush=True)
            if args.hold > 0:
                time.sleep(args.hold)
            return 0
        print("\n".join(header), flush=True)
        runs = []
        profile = None if args.profile is None else Path(args.profile)
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
        for rep in range(max(1, args.repeat)):
            for k, lib in enumerate(libs):
                run = run_library(topo, lib, sweep, extra, args.timeout,
                                  29400 + 10 * (rep * len(libs) + k), profile,
                                  args.trace_drops)
                print(f"#\n# ---- {lib} (rank 0's table)\n{run.table.rstrip()}", flush=True)
                runs.append(run)
    text = summary(runs, line_gbs)
    print("#\n" + text, flush=True)
    if args.out:
        body = [*header]
        for run in runs:
            body += ["#", f"# ---- {run.lib} (rank 0's table)", run.table.rstrip()]
        Path(args.out).write_text("\n".join([*body, "#", text]) + "\n")
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("netns_shaped: interrupted; everything it made is removed", file=sys.stderr)
        sys.exit(130)
