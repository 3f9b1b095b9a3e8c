"""A forked child lets go of acoll's sockets.

A process that forks without exec (multiprocessing's ``fork`` start method, data-loader
workers, a server's pre-forked workers) hands the child a copy of every descriptor,
acoll's connections included. A socket's peer sees end of file only when the last copy is
closed, so if the parent is then killed its peers learn nothing while the child lives:
they wait out their deadline instead of failing at once with ``RemoteError``.

Every socket acoll opens (bootstrap, TCP and shared-memory connections, their listeners)
is recorded here with its inode. In a forked child each recorded descriptor that still
names the same socket is pointed at ``/dev/null`` with ``dup2``: the number stays open,
so the child's later close of the Python object (a finalizer) closes ``/dev/null``, not
whatever reused the number; the connection is not shut down (that would cut the
parent's); and the child can no longer reach the parent's event-loop registrations
through it (an ``epoll`` instance is shared across fork, keyed by descriptor number).

Contract: :func:`hold` is cheap (one ``fstat``) and may be called from any thread; a
descriptor closed and reused later is told apart by its inode, so nothing needs to be
forgotten. Children created by ``fork`` + ``exec`` never see acoll's sockets (Python
opens them close-on-exec); forks made by C code that bypass Python's fork hooks are not
covered.
"""

from __future__ import annotations

import os
import socket
import stat

__all__ = ["hold", "held_in_child"]

_held: dict[int, int] = {}  # descriptor -> inode of the socket it named when held


def hold(sock: socket.socket | int | None) -> None:
    """Record ``sock`` (an object with ``fileno()`` or a descriptor) as acoll's: a forked
    child will let go of it. Closed or invalid descriptors are ignored."""
    if sock is None:
        return
    try:
        fd = sock if isinstance(sock, int) else sock.fileno()
        if fd < 0:
            return
        _held[fd] = os.fstat(fd).st_ino
    except (OSError, ValueError):
        return


def held_in_child() -> list[int]:
    """The recorded descriptors that still name the socket they named when recorded."""
    live = []
    for fd, ino in list(_held.items()):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if st.st_ino == ino and stat.S_ISSOCK(st.st_mode):
            live.append(fd)
    return live


def _let_go() -> None:
    """Runs in a forked child: point every live recorded socket at ``/dev/null``."""
    fds = held_in_child()
    _held.clear()
    if not fds:
        return
    try:
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for fd in fds:
            try:
                os.dup2(null, fd, inheritable=False)
            except OSError:
                pass
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_let_go)
