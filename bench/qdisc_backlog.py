"""Sample the queue of every shaped link of a running ``bench/netns_shaped.py`` topology.

Run it (as root) next to the benchmark: it waits for the hosts' namespaces
(``acollb<pid>h<i>``) to appear, then every ``--every`` seconds reads each host's egress
tbf (``tc -s qdisc show dev eth0`` in that namespace) until the namespaces are gone or
``--seconds`` pass, and prints the distribution of the backlog (bytes queued in tbf, that
is, queueing delay at the link rate) and each namespace's TCP congestion control::

    python bench/qdisc_backlog.py --rate 10gbit --seconds 60 > backlog.txt &
    python bench/netns_shaped.py ...

The question it answers: how much of the time between a ring step's send and its receive
is spent waiting in the link's queue (a sender that keeps megabytes in flight on a
10 Gbit/s link adds milliseconds to every dependency between steps).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

_NS_RE = re.compile(r"^(acollb\d+h\d+)\b")
_BACKLOG_RE = re.compile(r"backlog (\d+)([KMG]?)b (\d+)p")
_UNIT = {"": 1, "K": 1000, "M": 1000_000, "G": 1000_000_000}


def _hosts() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return sorted(m.group(1) for line in out.splitlines() if (m := _NS_RE.match(line)))


def _backlog(ns: str) -> int | None:
    out = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", "eth0"],
                         capture_output=True, text=True).stdout
    m = _BACKLOG_RE.search(out)
    return None if m is None else int(m.group(1)) * _UNIT[m.group(2)]


def _rate_bytes(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if m is None:
        raise SystemExit(f"--rate: tc syntax like 10gbit, not {rate!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="10gbit", help="the links' rate (tc syntax)")
    p.add_argument("--every", type=float, default=0.02, help="seconds between samples")
    p.add_argument("--seconds", type=float, default=120.0, help="stop after this long")
    p.add_argument("--wait", type=float, default=60.0,
                   help="seconds to wait for the namespaces to appear")
    args = p.parse_args()
    rate = _rate_bytes(args.rate)
    t0 = time.monotonic()
    hosts: list[str] = []
    while not hosts and time.monotonic() - t0 < args.wait:
        hosts = _hosts()
        time.sleep(0.2)
    if not hosts:
        print("qdisc_backlog: no acollb*h* namespace appeared", file=sys.stderr)
        return 1
    seen: set[str] = set()
    samples: list[int] = []
    end = time.monotonic() + args.seconds
    listed = 0.0
    while time.monotonic() < end:
        if time.monotonic() - listed > 1.0:  # (hosts appear one by one at set-up)
            hosts, listed = _hosts(), time.monotonic()
            for ns in hosts:
                if ns not in seen:
                    seen.add(ns)
                    cc = subprocess.run(["ip", "netns", "exec", ns, "cat",
                                         "/proc/sys/net/ipv4/tcp_congestion_control"],
                                        capture_output=True, text=True).stdout.strip()
                    print(f"# {ns}: tcp_congestion_control {cc or '?'}")
        alive = False
        for ns in hosts:
            b = _backlog(ns)
            if b is not None:
                alive = True
                if b > 0:  # (idle moments between runs would swamp the distribution)
                    samples.append(b)
        if not alive:
            break
        time.sleep(args.every)
    if not samples:
        print("# no busy sample")
        return 0
    samples.sort()
    n = len(samples)

    def q(f: float) -> int:
        return samples[min(n - 1, int(f * n))]

    print(f"# {n} busy samples of {len(seen)} egress queues (tbf backlog > 0)")
    for name, v in (("p10", q(0.10)), ("p50", q(0.50)), ("p90", q(0.90)),
                    ("p99", q(0.99)), ("max", samples[-1])):
        print(f"{name:>4} {v / 1e6:8.3f} MB  = {1e3 * v / rate:7.3f} ms at {args.rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
