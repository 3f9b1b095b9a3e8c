"""The acoll exception tree.

Every error acoll raises on purpose derives from :class:`AcollError`::

    AcollError
    ├── InvalidUsage (ValueError)      bad arguments, mismatched collectives, bad ids
    ├── BootstrapError                 the job could not be formed (root unreachable, ...)
    ├── TransportError                 a local network failure (socket, verbs, ...)
    │   └── ProtocolError              a malformed or unexpected frame arrived
    ├── RemoteError                    a peer rank died, aborted or broke the protocol
    ├── TimeoutError (TimeoutError)    a network wait passed its deadline
    └── ClosedError                    the communicator (or endpoint) was closed locally

Lower-level exceptions (``OSError``, ``asyncio.IncompleteReadError``, msgpack errors) are
translated once, where they cross a transport boundary, with ``raise ... from exc`` so the
original stays available as ``__cause__``.
"""

from __future__ import annotations

import builtins
import copy
from typing import TypeVar

__all__ = [
    "AcollError",
    "BootstrapError",
    "ClosedError",
    "InvalidUsage",
    "ProtocolError",
    "RemoteError",
    "TimeoutError",
    "TransportError",
]


class AcollError(Exception):
    """Base class of every error acoll raises on purpose."""


class InvalidUsage(AcollError, ValueError):
    """The caller (or another rank of the same job) used the API wrongly.

    Raised for bad arguments, ids that are not acoll ids, and collectives whose count,
    dtype, op or root differ between ranks (then on every rank of the job).

    Attributes:
        rank: when the error came from another rank (its call was invalid, or it found
            the disagreement), that rank; ``None`` when it was found here.
    """

    rank: int | None = None


class BootstrapError(AcollError):
    """The communicator could not be formed (root unreachable, handshake refused, ...)."""


class TransportError(AcollError):
    """A local network operation failed; ``__cause__`` holds the low-level error."""


class ProtocolError(TransportError):
    """Bytes arrived that do not follow acoll's wire format (bad magic, size, type...)."""


class RemoteError(AcollError):
    """A peer rank died, aborted, or broke the protocol.

    Attributes:
        rank: the rank that failed, when known (``None`` otherwise).
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple[type[RemoteError], tuple[str, int | None]]:
        return (type(self), (str(self), self.rank))


class TimeoutError(AcollError, builtins.TimeoutError):
    """A network wait passed its deadline (``ACOLL_TIMEOUT`` or a ``timeout=`` argument).

    Attributes:
        rank: the rank that was being waited for, when it is one rank (else ``None``).
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple[type[TimeoutError], tuple[str, int | None]]:
        return (type(self), (str(self), self.rank))


class ClosedError(AcollError):
    """The communicator or endpoint was closed (or aborted) on this rank."""


_E = TypeVar("_E", bound=BaseException)


def again(error: _E) -> _E:
    """A copy of ``error`` (same type, message, rank, attributes, notes and ``__cause__``)
    to raise for one more caller of a failed communicator. Raising the stored error itself would
    add every such caller's frames to its one traceback, keeping their arrays alive for as
    long as the communicator lives (found by review: 800 MiB after 50 calls)."""
    try:
        fresh = copy.copy(error)
    except Exception:  # (an error that cannot be copied: raised as it is)
        return error
    for name, value in vars(error).items():  # (attributes __reduce__ leaves out)
        vars(fresh).setdefault(name, value)
    notes = getattr(error, "__notes__", None)
    if isinstance(notes, list):
        vars(fresh)["__notes__"] = list(notes)  # (a note added to the copy stays there)
    fresh.__cause__ = error.__cause__
    fresh.__suppress_context__ = True
    fresh.__traceback__ = None
    return fresh
