"""Helpers to build throwaway Linux network namespaces for tests (root + iproute2 needed).

Namespaces are named ``acollt<pid><letter>``; :func:`cleanup_stale` removes those left by
test processes that no longer exist. Only private test addresses (``10.77.x.0/24``,
``fd77:x::/64``) are assigned, and only inside these namespaces.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PREFIX = "acollt"
CMD_TIMEOUT = 20.0
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)[a-z]$")


def skip_reason() -> str | None:
    """Why namespace tests cannot run here, or ``None`` when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns add)"
    if shutil.which("ip") is None:
        return "network namespace tests need iproute2's `ip` command"
    return None


def have_ipv6() -> bool:
    """Whether the kernel has IPv6 enabled."""
    return os.path.exists("/proc/sys/net/ipv6")


def sh(*args: str, timeout: float = CMD_TIMEOUT, check: bool = True) -> str:
    """Run one command (no shell), return its stdout; raise with stderr on failure."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def list_namespaces() -> list[str]:
    """Names of all network namespaces known to ``ip netns``."""
    out = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> None:
    """Delete ``acollt<pid>*`` namespaces whose creating process is gone."""
    for name in list_namespaces():
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            sh("ip", "netns", "del", name, check=False)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``ACOLL_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACOLL_")}
    env.update(extra)
    return env


@dataclass
class Namespaces:
    """A set of namespaces ``acollt<pid><letter>`` that :meth:`destroy` removes."""

    letters: Sequence[str]
    created: list[str] = field(default_factory=list)

    def name(self, letter: str) -> str:
        """The full namespace name for ``letter``."""
        return f"{PREFIX}{os.getpid()}{letter}"

    def create(self) -> None:
        """Create every namespace with loopback up and IPv6 DAD off (addresses usable now)."""
        for letter in self.letters:
            ns = self.name(letter)
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            if have_ipv6():
                for scope in ("all", "default"):
                    sh("ip", "netns", "exec", ns, "sysctl", "-qw",
                       f"net.ipv6.conf.{scope}.accept_dad=0", check=False)

    def ip(self, letter: str, *args: str) -> str:
        """Run ``ip -n <ns> args...``."""
        return sh("ip", "-n", self.name(letter), *args)

    def destroy(self) -> None:
        """Delete the namespaces (their interfaces go with them)."""
        for ns in self.created:
            sh("ip", "netns", "del", ns, check=False)
        self.created.clear()

    def wait_link_local(self, letter: str, dev: str, timeout: float = 10.0) -> str:
        """Wait until ``dev`` has an IPv6 link-local address; return it."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.ip(letter, "-6", "-o", "addr", "show", "dev", dev, "scope", "link")
            m = re.search(r"inet6 (fe80::[0-9a-f:]+)/", out)
            if m:
                return m.group(1)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no link-local address on {dev} in {self.name(letter)}")
            time.sleep(0.05)

    def python_args(self, letter: str, code: str, *argv: str) -> list[str]:
        """The command line running ``code`` with this interpreter inside the namespace."""
        return ["ip", "netns", "exec", self.name(letter), sys.executable, "-c", code, *argv]

    def run_py(self, letter: str, code: str, *argv: str, env: Mapping[str, str] | None = None,
               timeout: float = 60.0) -> Any:
        """Run ``code`` in the namespace; return the JSON its last stdout line holds."""
        proc = subprocess.run(self.python_args(letter, code, *argv), capture_output=True,
                              text=True, timeout=timeout, env=dict(env or clean_env()),
                              check=False)
        if proc.returncode != 0 or not proc.stdout.strip():
            raise RuntimeError(f"snippet in {self.name(letter)} failed ({proc.returncode}):\n"
                               f"{proc.stdout}\n{proc.stderr}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def popen_py(self, letter: str, code: str, *argv: str,
                 env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``code`` in the namespace with piped stdout/stderr (bytes)."""
        return subprocess.Popen(self.python_args(letter, code, *argv), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=dict(env or clean_env()))


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """Read one stdout line of ``proc`` within ``timeout`` seconds (``""`` at EOF)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no line from the subprocess in time")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    return buf.decode().partition("\n")[0]


def finish(procs: Sequence[subprocess.Popen[bytes]],
           timeout: float) -> list[tuple[int, str, str]]:
    """Wait for every process; return ``(rc, stdout, stderr)`` of each.

    Raises:
        RuntimeError: a process was still running after ``timeout`` seconds; all are killed
            and the message holds everything they wrote.
    """
    deadline = time.monotonic() + timeout
    timed_out = False
    results: list[tuple[int, str, str]] = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for other in procs:
                if other.poll() is None:
                    other.kill()
            out, err = proc.communicate(timeout=CMD_TIMEOUT)
        results.append((proc.returncode, out.decode(errors="replace"),
                        err.decode(errors="replace")))
    if timed_out:
        text = "\n".join(f"--- process {n} rc={rc}\n{out}\n{err}"
                         for n, (rc, out, err) in enumerate(results))
        raise RuntimeError(f"processes did not finish within {timeout}s:\n{text}")
    return results
