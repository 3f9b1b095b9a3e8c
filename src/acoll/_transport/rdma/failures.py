"""What verbs failures mean for a connection (sans-IO): the messages of ConnectionLost.

Two kinds of failure reach the transport:

- a work completion with an error status: the queue pair is in the error state (every
  other outstanding work request then completes with ``WR_FLUSH_ERR``, which only echoes
  the first error), see :func:`completion_failure`;
- an asynchronous event on the device: :func:`event_scope` says whether it ends one
  queue pair, every queue pair on a port, every queue pair of the device, or nothing
  (informational events).

Either way the connection fails with :class:`~acoll._transport.base.ConnectionLost`
(``orderly=False``) on every pending operation, which the communicator turns into a
:class:`~acoll.RemoteError` on every rank, as for TCP.
"""

from __future__ import annotations

import enum

from .spec import EVENT_NAMES, WC_STATUS_NAMES, WC_WR_FLUSH_ERR

__all__ = ["Scope", "completion_failure", "event_scope", "is_flush"]

_HINTS = {
    "RETRY_EXC_ERR": "the peer stopped answering (process or node gone, link down, or a "
                     "path/MTU/PSN mismatch)",
    "RNR_RETRY_EXC_ERR": "the peer had no receive posted for too long",
    "REM_ACCESS_ERR": "the peer refused an RDMA write (bad rkey or access flags)",
    "REM_INV_REQ_ERR": "the peer rejected a request (message larger than its receive)",
    "REM_OP_ERR": "the peer could not complete an operation",
    "LOC_PROT_ERR": "a local buffer was not registered for this access",
    "LOC_LEN_ERR": "a message was larger than the posted receive",
    "LOC_QP_OP_ERR": "the local queue pair rejected a work request",
    "LOC_ACCESS_ERR": "a local access violation",
    "WR_FLUSH_ERR": "the queue pair had entered the error state",
    "FATAL_ERR": "the device failed",
    "GENERAL_ERR": "the device reported a general error",
}


def is_flush(status: int) -> bool:
    """A flushed work request: a consequence of an earlier failure, not a cause."""
    return status == WC_WR_FLUSH_ERR


def completion_failure(status: int, what: str, peer: str, vendor_err: int = 0) -> str:
    """The message for a work completion that failed with ``status`` while ``what``
    (``"sending to"``, ``"writing to"``, ``"receiving from"``) ``peer``."""
    name = WC_STATUS_NAMES.get(status, f"status {status}")
    hint = _HINTS.get(name, "")
    vendor = f", vendor error {vendor_err:#x}" if vendor_err else ""
    return (f"RDMA {what} {peer} failed: {name}{vendor}" + (f" ({hint})" if hint else ""))


class Scope(enum.Enum):
    """What an asynchronous event ends."""

    NONE = "nothing (informational)"
    QP = "one queue pair"
    CQ = "the queue pairs using one completion queue"
    PORT = "every queue pair on the port"
    DEVICE = "every queue pair of the device"


_EVENT_SCOPE = {
    "QP_FATAL": Scope.QP, "QP_REQ_ERR": Scope.QP, "QP_ACCESS_ERR": Scope.QP,
    "PATH_MIG_ERR": Scope.QP, "CQ_ERR": Scope.CQ, "PORT_ERR": Scope.PORT,
    "DEVICE_FATAL": Scope.DEVICE,
}


def event_scope(event_type: int) -> tuple[Scope, str]:
    """The scope of an asynchronous event and its name (``IBV_EVENT_...``)."""
    name = EVENT_NAMES.get(event_type, f"event {event_type}")
    return _EVENT_SCOPE.get(name, Scope.NONE), name
