"""Connection authentication: a challenge-response on every connection, without I/O.

Every connection a rank or the root accepts (root, bootstrap listener, data listener) runs
the same three-message exchange before anything else is believed::

    acceptor  -> connector   nonce_a                      (32 random bytes, at accept)
    connector -> acceptor    nonce_c, claims, proof_c     proof_c = MAC(connect | ... )
    acceptor  -> connector   proof_a                      proof_a = MAC(accept  | ... )

``MAC`` is keyed BLAKE2b-256 under the job's authentication key (derived from the
:class:`~acoll.UniqueId` secret). Both proofs cover both nonces, the connection's purpose
(``context``) and the connector's ``claims`` (its rank, the job size, and for the data
network the socket's place in its connection): a recorded exchange cannot be replayed
(the other side's nonce is fresh), a proof cannot be moved to another rank or purpose,
and the connector also learns that the acceptor holds the key before trusting anything it
says. Nothing secret ever crosses the wire.

:class:`PreAuthGate` bounds what unauthenticated peers can hold: at most ``limit``
connections per listener may be in the exchange at once (the oldest is dropped to make room
for a new one, so a flood cannot lock out ranks, whose exchange takes one round trip; a
bootstrap connector dropped before its challenge came tries again), and each has a
deadline. Frames accepted before authentication are capped at :data:`PREAUTH_MAX_FRAME`
bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable

from ._config import Setting, parse_seconds

__all__ = [
    "NONCE_SIZE",
    "PREAUTH_LIMIT",
    "PREAUTH_MAX_FRAME",
    "PREAUTH_TIMEOUT",
    "PROOF_SIZE",
    "PreAuthGate",
    "RefusalLog",
    "auth_key",
    "new_nonce",
    "prove",
    "verify",
]

NONCE_SIZE = 32
PROOF_SIZE = 32
#: Largest frame body a listener reads from a connection that has not authenticated.
PREAUTH_MAX_FRAME = 16 << 10

PREAUTH_LIMIT = Setting(
    "PREAUTH_LIMIT", int, 128,
    "Connections per listener that may be authenticating at once (the oldest is dropped "
    "when a new one arrives at the limit).", "NET", lo=1)
PREAUTH_TIMEOUT = Setting(
    "PREAUTH_TIMEOUT", parse_seconds, 10.0,
    "Seconds a new connection has to complete authentication before it is dropped.", "NET")

CONNECT = b"acoll-connect"
ACCEPT = b"acoll-accept"


def auth_key(secret: bytes) -> bytes:
    """The 32-byte key every proof of one job is made with (never sent anywhere)."""
    return hashlib.blake2b(secret, digest_size=32, person=b"acoll-auth").digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


def _frame(*parts: bytes) -> bytes:
    # length-prefixed so that no two different part lists give the same bytes
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def prove(key: bytes, role: bytes, context: bytes, nonce_a: bytes, nonce_c: bytes,
          claims: bytes) -> bytes:
    """The proof ``role`` (:data:`CONNECT` or :data:`ACCEPT`) sends for one exchange."""
    return hashlib.blake2b(_frame(role, context, nonce_a, nonce_c, claims), key=key,
                           digest_size=PROOF_SIZE).digest()


def verify(proof: bytes, key: bytes, role: bytes, context: bytes, nonce_a: bytes,
           nonce_c: bytes, claims: bytes) -> bool:
    """Whether ``proof`` is the one :func:`prove` gives for these values (constant time)."""
    if len(proof) != PROOF_SIZE or len(nonce_a) != NONCE_SIZE or len(nonce_c) != NONCE_SIZE:
        return False
    return hmac.compare_digest(proof, prove(key, role, context, nonce_a, nonce_c, claims))


class RefusalLog:
    """Reports refused connections without letting a flood of them flood the log: at
    most one WARNING a second per listener (with the count of those not shown), the rest at
    DEBUG."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._last = -1e9
        self._hidden = 0

    def refused(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last >= 1.0:
            if self._hidden:
                fmt += f" ({self._hidden} more refused since the last report)"
            self._log.warning(fmt, *args)
            self._last, self._hidden = now, 0
        else:
            self._hidden += 1
            self._log.debug(fmt, *args)

    def closed(self, fmt: str, *args: object) -> None:
        """A connection that ended before saying anything: logged at INFO only."""
        self._log.info(fmt, *args)


class PreAuthGate:
    """Tracks one listener's connections that have not authenticated yet.

    ``admit(drop)`` registers a new connection and returns its token; ``drop`` is called
    (at most once) if the connection is evicted to make room. ``leave(token)`` removes it
    once it authenticated or failed. At most ``limit`` connections are tracked: admitting
    one more evicts the oldest.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = max(1, PREAUTH_LIMIT.resolve(limit))
        self._pending: OrderedDict[int, Callable[[], object]] = OrderedDict()
        self._next = 0
        self.evicted = 0

    def admit(self, drop: Callable[[], object]) -> int:
        while len(self._pending) >= self.limit:
            _, oldest = self._pending.popitem(last=False)
            self.evicted += 1
            oldest()
        token = self._next
        self._next += 1
        self._pending[token] = drop
        return token

    def leave(self, token: int) -> None:
        self._pending.pop(token, None)

    def __len__(self) -> int:
        return len(self._pending)
