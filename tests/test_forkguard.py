"""A forked child lets go of acoll's sockets, and only of acoll's live ones."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys

import pytest

import acoll
from acoll import _forkguard

# The fork itself runs in a fresh interpreter: forking the test process, which has other
# threads (socket and native-ring helpers, uvloop's), can leave the child stuck on a lock
# one of them held (seen once: a child blocked on a futex forever, and its parent with it).
_SCENARIOS = r"""
import json, os, socket, stat, sys
from acoll import _forkguard

def kind(fd):
    st = os.fstat(fd)
    if stat.S_ISSOCK(st.st_mode):
        return "socket"
    return "devnull" if st.st_rdev == os.stat(os.devnull).st_rdev else "other"

def in_child(report):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.write(w, json.dumps(report()).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)

out = {}
name = sys.argv[1]
if name == "held":
    a, b = socket.socketpair()
    other, other_peer = socket.socketpair()  # not acoll's
    _forkguard.hold(a)
    out["child"] = in_child(lambda: {"held": kind(a.fileno()), "other": kind(other.fileno())})
    a.sendall(b"ping")  # the parent's connection is whole
    out["b_got"] = b.recv(4).decode()
    b.sendall(b"pong")
    out["a_got"] = a.recv(4).decode()
elif name == "child_closes":
    a, b = socket.socketpair()
    _forkguard.hold(a)
    a_fd = a.fileno()
    in_child(lambda: {"closed": os.close(a_fd) is None})  # as a finalizer would
    b.setblocking(False)
    try:
        out["b_got"] = b.recv(1).decode()  # "" would be an end of file
    except BlockingIOError:
        out["b_got"] = None
elif name == "reused":
    a, b = socket.socketpair()
    fd = a.fileno()
    _forkguard.hold(a)
    a.close()
    b.close()
    c, d = socket.socketpair()  # the number comes back for a socket acoll never held
    out["same_number"] = c.fileno() == fd
    out["child"] = in_child(lambda: {"kind": kind(fd)})
    with open(os.devnull, "rb") as f:
        _forkguard.hold(f.fileno())  # (not a socket: never touched either)
        out["file_held"] = f.fileno() in _forkguard.held_in_child()
print(json.dumps(out))
"""


def _scenario(name: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", _SCENARIOS, name], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def test_a_forked_child_points_held_sockets_at_dev_null_and_the_parent_keeps_them() -> None:
    out = _scenario("held")
    assert out["child"] == {"held": "devnull", "other": "socket"}
    assert out["b_got"] == "ping"  # the child neither shut it down nor closed it
    assert out["a_got"] == "pong"


def test_the_child_closing_its_copy_leaves_the_peer_without_end_of_file() -> None:
    out = _scenario("child_closes")
    assert out["b_got"] is None  # no end of file: the parent still holds the connection


def test_a_reused_descriptor_number_is_left_alone() -> None:
    out = _scenario("reused")
    assert out["same_number"] is True  # (the case this test is about)
    assert out["child"] == {"kind": "socket"}
    assert out["file_held"] is False


def test_hold_ignores_what_is_not_open() -> None:
    s = socket.socket()
    s.close()
    _forkguard.hold(s)  # fileno() is -1
    _forkguard.hold(None)
    _forkguard.hold(10_000)  # EBADF
    assert 10_000 not in _forkguard.held_in_child()


@pytest.mark.parametrize("shm", ["0", "1"], ids=["shm", "tcp"])
def test_a_communicators_sockets_are_held(shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every socket formed communicators keep open (data links over shared memory or TCP,
    bootstrap, listeners) is recorded, so a forked child lets go of all of them. (Ranks
    of one process, the in-process transport off: their links are real sockets.)"""
    monkeypatch.setenv("ACOLL_INPROC_DISABLE", "1")
    monkeypatch.setenv("ACOLL_SHM_DISABLE", shm)

    async def main() -> tuple[set[int], set[int]]:
        uid = acoll.get_unique_id()
        comms = await asyncio.gather(*(acoll.init_rank(3, uid, r) for r in range(3)))
        loop = asyncio.get_running_loop()
        wakeup = {s.fileno() for s in (getattr(loop, "_ssock", None),
                                       getattr(loop, "_csock", None)) if s is not None}
        try:
            mine = set(_socket_fds()) - wakeup  # (the loop's own wake-up pair)
            return mine, set(_forkguard.held_in_child())
        finally:
            await asyncio.gather(*(c.close() for c in comms))

    before = set(_socket_fds())
    sockets, held = asyncio.run(main())
    new = sockets - before
    assert new, "the communicators opened no sockets?"
    assert new <= held, f"sockets not held: {sorted(new - held)}"


def _socket_fds() -> list[int]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                out.append(fd)
        except OSError:
            continue
    return out
