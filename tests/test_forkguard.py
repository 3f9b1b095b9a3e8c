"""A forked child lets go of acoll's sockets, and only of acoll's live ones."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import warnings

import pytest

import acoll
from acoll import _forkguard


def _in_child(report: object) -> dict[str, object]:
    """Fork; the child runs ``report()`` (a dict) and writes it back; return it."""
    r, w = os.pipe()
    with warnings.catch_warnings():  # (3.12 warns when other threads exist: they are
        warnings.simplefilter("ignore", DeprecationWarning)  # idle pools; the child
        pid = os.fork()  # only reads descriptors and writes to its pipe)
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(r)
            os.write(w, json.dumps(report()).encode())  # type: ignore[operator]
        finally:
            os._exit(0)
    os.close(w)
    try:
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    result: dict[str, object] = json.loads(data)
    return result


def _kind(fd: int) -> str:
    st = os.fstat(fd)
    if stat.S_ISSOCK(st.st_mode):
        return "socket"
    null = os.stat(os.devnull)
    return "devnull" if st.st_rdev == null.st_rdev else "other"


def test_a_forked_child_points_held_sockets_at_dev_null_and_the_parent_keeps_them() -> None:
    a, b = socket.socketpair()
    other, other_peer = socket.socketpair()  # not acoll's
    with a, b, other, other_peer:
        _forkguard.hold(a)
        seen = _in_child(lambda: {"held": _kind(a.fileno()), "other": _kind(other.fileno())})
        assert seen == {"held": "devnull", "other": "socket"}
        # the parent's connection is whole: the child neither shut it down nor closed it
        a.sendall(b"ping")
        assert b.recv(4) == b"ping"
        b.sendall(b"pong")
        assert a.recv(4) == b"pong"


def test_the_child_closing_its_copy_leaves_the_peer_without_end_of_file() -> None:
    a, b = socket.socketpair()
    with a, b:
        _forkguard.hold(a)
        # the child closes the Python object as a finalizer would: /dev/null goes, not a
        a_fd = a.fileno()
        _in_child(lambda: {"closed": os.close(a_fd) is None})
        b.setblocking(False)
        try:
            got = b.recv(1)
        except BlockingIOError:
            got = None
        assert got is None  # no end of file: the parent still holds the connection


def test_a_reused_descriptor_number_is_left_alone() -> None:
    a, b = socket.socketpair()
    fd = a.fileno()
    _forkguard.hold(a)
    a.close()
    b.close()
    # the number comes back for a socket acoll never held (and for a plain file)
    c, d = socket.socketpair()
    with c, d:
        if c.fileno() == fd:
            assert _in_child(lambda: {"kind": _kind(fd)}) == {"kind": "socket"}
        assert fd not in _forkguard.held_in_child() or c.fileno() != fd
    with open(os.devnull, "rb") as f:
        _forkguard.hold(f.fileno())  # (not a socket: never touched either)
        assert f.fileno() not in _forkguard.held_in_child()


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
