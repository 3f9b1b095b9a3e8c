"""Tell ``acoll-run`` why a rank is exiting, so it can blame the rank that failed first.

When a rank leaves, its peers fail with :class:`~acoll.errors.RemoteError` and often exit
*before* it does (the rank that left closes its sockets first, then runs the interpreter's
shutdown). Process exit order therefore does not say who failed first. ``acoll-run`` gives
each rank a file path in ``ACOLL_RUN_REPORT`` (a memfd of the launcher's, by its /proc
path); at import, acoll wraps ``sys.excepthook`` so that an uncaught exception caused by
another rank (a ``RemoteError``, or an ``InvalidUsage`` another rank reported, anywhere in
its cause/context chain or exception groups) writes ``{"peer": rank-or-null, "error":
text}`` as JSON there before the process exits. The launcher treats such a rank's
failure as a consequence and waits briefly for the rank that caused it (see
:mod:`acoll.run`).

Contract: nothing is written for any other exit (``sys.exit(n)``, signals, other errors);
writing never raises; the previous ``sys.excepthook`` is always called.
"""

from __future__ import annotations

import json
import os
import sys
from types import TracebackType

from .errors import InvalidUsage, RemoteError

__all__ = ["ENV_VAR", "REPORT_MEMFD", "REPORT_SLOT", "find_remote_error", "install",
           "parse_report", "read_report"]

#: The variable through which ``acoll-run`` passes a rank its report file.
ENV_VAR = "ACOLL_RUN_REPORT"
#: The name of ``acoll-run``'s report memfd: one for the job, a slot of ``REPORT_SLOT``
#: bytes per rank (one descriptor, not one per rank: review, session 57).
REPORT_MEMFD = "acoll-run-reports"
REPORT_SLOT = 4096


def find_remote_error(exc: BaseException | None) -> RemoteError | InvalidUsage | None:
    """The first error from another rank in ``exc``, its causes, contexts and groups: a
    :class:`RemoteError`, or an :class:`InvalidUsage` a peer reported (its ``rank`` set:
    the peer's call was invalid, or it found the disagreement)."""
    seen: set[int] = set()
    todo: list[BaseException] = [] if exc is None else [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RemoteError) or (isinstance(e, InvalidUsage) and e.rank is not None):
            return e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        todo.extend(getattr(e, "exceptions", ()))  # BaseExceptionGroup (3.11+)
    return None


def _write(path: str, exc: BaseException) -> None:
    remote = find_remote_error(exc)
    if remote is None or (remote.rank is not None
                          and str(remote.rank) == os.environ.get("ACOLL_RANK")):
        return  # (this rank's own doing: the root reports a bad hello to its sender too)
    try:
        error = f"{type(remote).__name__}: {remote}"
        text = json.dumps({"peer": remote.rank, "error": error})
        while len(text.encode()) > REPORT_SLOT:  # (a slot of the launcher's memfd)
            error = error[:len(error) // 2]
            text = json.dumps({"peer": remote.rank, "error": error})
        if path.startswith("/proc/"):
            # Slot ``#n`` of a launcher's memfd, written in place (the launcher reads it
            # once this process exited; a torn write reads as no report). Only while it
            # is one: a launcher that died leaves a path that may name another process's
            # file once its pid is reused (found by review, session 57).
            where, _, slot = path.rpartition("#")
            if not os.readlink(where).startswith(f"/memfd:{REPORT_MEMFD}"):
                return
            fd = os.open(where, os.O_WRONLY)
            try:
                os.pwrite(fd, text.encode(), int(slot) * REPORT_SLOT)
            finally:
                os.close(fd)
            return
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass


def install(environ: dict[str, str] | None = None) -> bool:
    """Wrap ``sys.excepthook`` when ``ACOLL_RUN_REPORT`` is set; return whether it did."""
    path = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not path or getattr(sys.excepthook, "_acoll_report", False):
        return False
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException,
             tb: TracebackType | None) -> None:
        _write(path, exc)
        previous(kind, exc, tb)

    hook._acoll_report = True  # type: ignore[attr-defined]
    sys.excepthook = hook
    return True


def read_report(path: str) -> tuple[int | None, str] | None:
    """``(peer, error)`` from a report file, or ``None`` when there is none (or it is bad)."""
    try:
        with open(path, "rb") as f:
            return parse_report(f.read())
    except OSError:
        return None


def parse_report(raw: bytes) -> tuple[int | None, str] | None:
    """``(peer, error)`` from a report's bytes (a memfd slot's, padded with NULs), or
    ``None`` when there is none (or it is bad)."""
    try:
        data = json.loads(raw.rstrip(b"\0") or b"null")
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    peer = data.get("peer")
    error = data.get("error")
    return (peer if isinstance(peer, int) else None, error if isinstance(error, str) else "")
