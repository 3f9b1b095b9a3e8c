"""Shared-memory transport: ranks in other processes of this host exchange messages through
rings in a memory segment both processes map (NCCL's SHM transport).

Design
------
A connection is a memfd segment holding two rings (one per direction, see
:mod:`.shmring`) and a Unix stream socket, the *control stream*, which carried the
handshake and then the segment's file descriptor, and afterwards carries only wake-up
bytes and the close frame. No thread: everything runs on the event loop.

- Sending copies the message into the ring (in parts of at most a quarter of the ring),
  and the send completes once its last part is in the ring. A part is written at once when
  there is room; otherwise the sender asks the receiver to wake it when room is freed.
- Receiving: the receiver reads records in order and copies each payload straight into
  the posted receive buffer, or into storage when the receive is not posted yet (matched
  by :class:`~.matching.Matcher` under the rules of :mod:`.base`). Storage is pooled per
  connection, so a steady stream of early messages does not allocate.
- Notification: the control socket is registered with ``loop.add_reader``. A side that may
  sleep (its loop waits in the poller) sets a word in the ring's control page; the other
  side, after publishing data (or releasing room), wakes it with one byte on the socket,
  once per request. :meth:`ShmConnection.poll` (the communicator's bounded busy-poll for
  small ops) withdraws the receive request while it polls and renews it on the next loop
  step, so a peer answering within the busy-poll makes no system call at all.
- Bounded work per loop step: every callback moves data for at most ``_IO_NS`` (0.2 ms),
  then comes back on the next loop iteration; a message kept in storage is copied out in
  slices, one per iteration (:mod:`.copyout`).
- Failure: the peer's death closes its end of the control socket, so the loop sees end of
  file at once (SIGKILL included) and every pending operation fails with
  :class:`~.base.ConnectionLost`. An orderly close flushes queued sends into the ring, then
  sends the close frame (with the notice) on the socket; the receiver consumes what is
  left in the ring before it reports the close.
- Cleanup: a memfd has no name, so nothing is ever left in ``/dev/shm``; its memory is
  freed when the last process unmaps it or dies. The listener's socket lives in the
  abstract namespace, which vanishes with the socket.

Reaching a listener: the handle is ``b"ACSH" | H version | H lane (64-byte units) |
Q network namespace | 16s token``; the socket is ``"\\0acoll-shm-" + token.hex()``.
Abstract sockets belong to a network namespace, so :meth:`ShmTransport.can_connect`
accepts a pair only when both ranks are on one host (``PeerInfo.host_hash``), in
different processes, and in the same
network namespace.

Handshake on the control socket (little endian), the exchange of :mod:`acoll._auth`::

    listener  -> connector  4s b"ACSH" | H version | 2x | 32s nonce_a
    connector -> listener   4s b"ACSH" | H version | 2x | 32s nonce_c | I hello length
                            | hello | 32s proof
    listener  -> connector  32s proof | Q ring capacity | Q lane bytes, with the segment's
                            memfd attached (SCM_RIGHTS); capacity 0 and no memfd: no memory
                            for a segment

The listener creates and maps the segment only for a connector that proved the job's key;
its own proof also covers the ring capacity. The connector maps the segment only after
checking that proof, the memfd's size and its seals (it can neither shrink nor grow, so the
peer cannot make a later access fault). Only x86-64 is supported: the rings rely on its
store order (see :mod:`.shmring`).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import fcntl
import mmap
import os
import platform
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable

from .. import _auth, _forkguard
from .._config import Setting, get_logger, parse_bool, parse_size
from .._deadline import wait_for, wait_until
from .._dtypes import empty_bytes
from .._memory import Buffer
from .._offloop import in_thread, submit, unmap
from ..errors import AcollError, ProtocolError, TransportError
from . import shmlane, shmring
from .accepting import Evicted, HandshakeListener
from .base import (
    META_SIZE,
    Capability,
    ConnectionLost,
    PeerInfo,
    Transport,
)
from .copyout import PacedCopies
from .lifecycle import FutureConnection
from .matching import Matcher, Message

__all__ = ["DISABLE", "LANE_MAX", "RING_SIZE", "ShmConnection", "ShmListener", "ShmTransport",
           "auto_lane", "handle_lane", "handle_netns",
           "make_shm", "unsupported"]

log = get_logger("NET")

DISABLE = Setting("SHM_DISABLE", parse_bool, False,
                  "Never use shared memory between processes of one host (they then use the "
                  "network, as with NCCL_SHM_DISABLE).", "NET")
RING_SIZE = Setting("SHM_RING_SIZE", parse_size, 2 << 20,
                    "Bytes of messages each direction of a shared-memory connection holds "
                    "(a multiple of 4 KiB, at least 16 KiB); messages larger than a quarter "
                    "of it (or than 1 MiB) travel in parts.", "NET")
def _parse_lane(text: str) -> int:
    return -1 if text.strip().lower() == "auto" else parse_size(text)


LANE_MAX = Setting("SHM_LANE_MAX", _parse_lane, -1,
                   "Largest payload per peer of a collective that ranks of one host in "
                   "different processes run through shared mailboxes in one step instead "
                   "of messages (the lane: busy-polled, used only with a core per local "
                   "rank; larger collectives but reduce go through it in steps of this "
                   "size); auto "
                   "(-1): 2 MiB for 2 ranks, else 4 MiB / (ranks - 1), from 64 KiB to 1 MiB; "
                   "else a multiple of 64, at most 2 MiB (steps move at most 1 MiB per "
                   "peer, 2-rank all_reduce steps 512 KiB); 0 turns the lane "
                   "off.", "COLL")
#: what the automatic lane size shares out between a rank's peers, and its bounds
LANE_BUDGET = 4 << 20
LANE_FLOOR = 64 << 10
LANE_CEILING = 1 << 20
#: the automatic lane of 2 ranks: a 2 MiB all_reduce in one step (one copy into the slot,
#: one combine) took 120 to 123 us against 134 to 173 in two steps on the 2-core VM
LANE_PAIR = 2 << 20


def auto_lane(nranks: int) -> int:
    """The lane size (payload bytes per peer) ``ACOLL_SHM_LANE_MAX=auto`` gives a
    communicator of ``nranks``: an op's work grows with the number of peers it reads.
    Communicators of more than 8 ranks get none (each pair would need a segment)."""
    if nranks > 8:
        return 0
    if nranks == 2:
        return LANE_PAIR
    per_peer = LANE_BUDGET // max(nranks - 1, 1)
    return max(LANE_FLOOR, min(LANE_CEILING, per_peer)) & ~63
MAX_EARLY = Setting("SHM_MAX_EARLY", parse_size, 4 << 30,
                    "Largest shared-memory message kept in memory when it arrives before its "
                    "receive is posted (or drained when its size is wrong); a larger one "
                    "fails the connection with ProtocolError.", "NET", lo=0)

_HANDLE = struct.Struct("<4sHHQ16s")
_MAGIC = b"ACSH"
_VERSION = 2
_CHAL = struct.Struct("<4sH2x32s")
_HS = struct.Struct("<4sH2x32sI")
_ACK = struct.Struct("<32sQQ")
_CONTEXT = b"shm"
_REFUSED = bytes(_ACK.size)  # sent instead of the answer: "you do not hold the key"
_MAX_HELLO = _auth.PREAUTH_MAX_FRAME
_MAX_RING = 1 << 30
_EVICTED_RETRIES = 20
_LINGER = 5.0  # how long a closing connection waits for the peer's close or end of file
_IO_NS = 200_000  # a callback or poll starts no new copy after this (ns)
_COPY_SLICE = 128 << 10  # bytes copied out of the ring between two looks at the clock
_PART_MAX = 1 << 20  # most bytes of one message part, written into the ring in one copy
_ALIGNED_MIN = 4096  # payloads from this size on are placed at their source's alignment
_POOL_BYTES = 32 << 20  # storage kept for reuse, per connection
_POOL_PER_SIZE = 8
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(
    fcntl, "F_SEAL_SHRINK") else 0


def unsupported() -> str:
    """Why shared memory cannot be used here, or ``""`` when it can."""
    if not sys.platform.startswith("linux"):
        return "needs Linux (memfd and abstract Unix sockets)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs x86-64 store ordering (this is {platform.machine()})"
    if not hasattr(os, "memfd_create") or not _SEALS:
        return "this Python has no memfd_create or file seals"
    return ""


def _netns() -> int:
    """An id of this process's network namespace (0 if it cannot be read)."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def handle_lane(handle: bytes) -> int:
    """The lane size (bytes) a shared-memory handle announces; 0 for none or a bad one."""
    if len(handle) != _HANDLE.size:
        return 0
    magic, version, lane, _netns, _token = _HANDLE.unpack(handle)
    return lane * 64 if magic == _MAGIC and version == _VERSION else 0


def handle_netns(handle: bytes) -> int | None:
    """The network namespace a shared-memory handle names; ``None`` for a bad one."""
    parsed = _parse_handle(handle)
    return None if parsed is None else parsed[0]


def _parse_handle(handle: bytes) -> tuple[int, bytes] | None:
    """``(network namespace, socket name)`` of a shared-memory handle, or ``None``."""
    if len(handle) != _HANDLE.size:
        return None
    magic, version, _lane, netns, token = _HANDLE.unpack(handle)
    if magic != _MAGIC or version != _VERSION:
        return None
    return netns, b"\0acoll-shm-" + token.hex().encode()


class _Pool:
    """Storage for early messages, kept for reuse by exact size (bounded)."""

    __slots__ = ("_bytes", "_free")

    def __init__(self) -> None:
        self._free: dict[int, list[memoryview]] = {}
        self._bytes = 0

    def get(self, nbytes: int) -> memoryview:
        spare = self._free.get(nbytes)
        if spare:
            self._bytes -= nbytes
            return spare.pop()
        return empty_bytes(nbytes).data  # not zeroed: pages are faulted in as written

    def put(self, storage: memoryview) -> None:
        nbytes = storage.nbytes
        if not nbytes or self._bytes + nbytes > _POOL_BYTES:
            return
        spare = self._free.setdefault(nbytes, [])
        if len(spare) < _POOL_PER_SIZE:
            spare.append(storage)
            self._bytes += nbytes


class _Send:
    __slots__ = ("fut", "meta", "pad", "pos", "tag", "total", "view")

    def __init__(self, fut: asyncio.Future[None], view: memoryview, tag: int, meta: bytes,
                 pad: int) -> None:
        self.fut = fut
        self.view = view
        self.tag = tag
        self.meta = meta
        self.pad = pad
        self.total = view.nbytes
        self.pos = 0


_Msg = Message[asyncio.Future[bytes], None]


class ShmConnection(FutureConnection):
    """A :class:`~.base.Connection` over a shared segment and its control socket (see the
    module doc). ``rx_index`` is the ring this end reads (0 for the acceptor)."""

    def __init__(self, sock: socket.socket, mm: mmap.mmap, rx_index: int, peer: str, *,
                 max_early: int | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._fd = sock.fileno()
        self._mm = mm
        self._mem = memoryview(mm)
        layout = shmring.SegmentLayout.read_header(self._mem)
        self._rx_ring = shmring.Ring(self._mem, layout, rx_index)
        self._tx_ring = shmring.Ring(self._mem, layout, 1 - rx_index)
        self._rx = shmring.Consumer(self._rx_ring)
        self._tx = shmring.Producer(self._tx_ring)
        self._layout = layout
        self._rx_index = rx_index
        # parts are a multiple of 64 bytes, so every part of a message keeps its alignment;
        # at most _PART_MAX: a part is written in one copy on the loop (a 1 GiB ring's
        # quarter was a 256 MiB copy in one go)
        self._part = min(layout.capacity // 4, _PART_MAX)
        self.peer = peer
        self._pool = _Pool()
        self._match: Matcher[asyncio.Future[bytes], None] = Matcher(
            self._pool.get, max_early=MAX_EARLY.resolve(max_early),
            limit_name="ACOLL_SHM_MAX_EARLY")
        self._copies = PacedCopies(self._loop,
                                   lambda exc: self._internal_error("receiving from", exc),
                                   self._pool.put)
        self._sendq: deque[_Send] = deque()
        self._parser = shmring.ControlParser()
        # the record being copied out of the ring, where to, and how far
        self._cur: shmring.Record | None = None
        self._cur_msg: _Msg | None = None
        self._cur_dest: memoryview | None = None
        self._cur_pos = 0
        self._failed: ConnectionLost | None = None
        self._on_failure: Callable[[ConnectionLost], None] | None = None
        self._closing = False
        self._close_out: bytes | None = None  # the close frame still to write (part)
        self._sent_close = False
        self._peer_eof = False
        self._scheduled = False  # a _service call is scheduled
        self._reading = True
        self._writing = False
        self._released: asyncio.Future[None] = self._loop.create_future()
        self._loop.add_reader(self._fd, self._on_readable)
        if self._rx.arm():
            self._schedule()

    # ------------------------------------------------------------------ public
    def mailboxes(self) -> tuple[shmlane.Outbox, shmlane.Inbox] | None:
        """This end's mailboxes for the communicator's lane (:mod:`.shmlane`): views of the
        segment that the caller owns (they stay valid after the connection closes, until
        the caller releases them and calls :meth:`unmap_if_released`). ``None`` when the
        segment has none or the connection is already released."""
        layout = self._layout
        if not layout.lane or self._fd < 0:
            return None
        whole = memoryview(self._mm)
        out_at, in_at = layout.box_offset(1 - self._rx_index), layout.box_offset(self._rx_index)
        boxes = (shmlane.Outbox(whole[out_at:out_at + layout.box], layout.lane),
                 shmlane.Inbox(whole[in_at:in_at + layout.box], layout.lane))
        whole.release()
        return boxes

    def unmap_if_released(self) -> None:
        """Unmap the segment if the connection is released and nothing maps it any more
        (the lane released its mailboxes after the connection closed)."""
        if self._fd < 0:
            _unmap_soon(self._loop, self._mm)

    def isend(self, buffer: Buffer, tag: int, meta: bytes = bytes(META_SIZE)
              ) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        if self._failed is not None or self._closing:
            fut.set_exception(self._failed or ConnectionLost("connection is closing"))
            fut.exception()  # awaiting it still raises; abandoned, it must not log
            return fut
        if not 0 <= tag < 1 << 64 or len(meta) != META_SIZE:
            raise ValueError(f"bad tag {tag!r} or meta of {len(meta)} bytes")
        view = buffer.view()
        nbytes = view.nbytes
        pad = buffer.ptr % shmring.ALIGN if nbytes >= _ALIGNED_MIN else 0
        try:
            if not self._sendq and nbytes <= self._part:
                # fast path: a message of one part into a ring with room, nothing queued
                tx = self._tx
                if tx.write(tag, nbytes, 0, view, meta, pad):
                    if tx.consumer_wants_wake():
                        self._wake()
                    fut.set_result(None)
                    return fut
            self._sendq.append(_Send(fut, view, tag, meta, pad))
            if len(self._sendq) == 1:
                self._flush()
        except ProtocolError as exc:
            self._lost(ConnectionLost(f"{self.peer} broke the protocol: {exc}"))
            self._fail_send(fut)
        except Exception as exc:
            self._internal_error("sending to", exc)
            self._fail_send(fut)
        return fut

    def _fail_send(self, fut: asyncio.Future[None]) -> None:
        """Fail a send the connection broke under before it was queued (if not done)."""
        if not fut.done():
            fut.set_exception(self._failed or ConnectionLost("the connection failed"))
            fut.exception()

    def poll(self) -> None:
        """Consume what has arrived and write what fits, within one ``_IO_NS`` budget.

        While the owner polls, the peer need not wake this end: the wake-up request is
        withdrawn, and renewed on the next loop step (when the owner may sleep).
        """
        if self._fd < 0:
            return
        try:
            self._rx.disarm()
            self._schedule()
            self._read(time.perf_counter_ns() + _IO_NS)
            if self._sendq and self._failed is None:
                self._flush()
        except ProtocolError as exc:
            self._lost(ConnectionLost(f"{self.peer} broke the protocol: {exc}"))
        except Exception as exc:
            self._internal_error("polling", exc)

    def close(self, notice: bytes = b"", *, drop_queued: bool = False) -> None:
        if self._closing or self._failed is not None:
            return
        self._closing = True
        lost = ConnectionLost("the connection was closed locally")
        self._fail_pending(lost, sends=False)
        if drop_queued:
            # Failure path: queued data no longer matters and must not hold the notice (or
            # the owner's waits) behind a peer that may have stopped reading.
            self._fail_sends(lost)
        self._close_out = shmring.close_frame(notice[:shmring.MAX_NOTICE])
        if not self._sendq:
            self._send_close()
        self._loop.call_later(_LINGER, self._release_guarded)

    def abort(self) -> None:
        if self._failed is None:
            self._failed = ConnectionLost("the connection was aborted locally")
        if self._closing and self._close_out is not None and not self._sendq:
            # A close notice may still be waiting (a failure being reported): give it one
            # non-blocking chance to leave, so the peer learns the cause, not just an EOF.
            self._write_close()
        self._fail_pending(self._failed, sends=True)
        self._release()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._released)

    # ------------------------------------------------------------------ failure
    def _fail_sends(self, exc: ConnectionLost) -> None:
        for s in self._sendq:
            if not s.fut.done():
                s.fut.set_exception(exc)
                s.fut.exception()
        self._sendq.clear()

    def _fail_pending(self, exc: ConnectionLost, *, sends: bool) -> None:
        # Futures failed here are marked retrieved: the owner learns of the failure through
        # the failure callback, and ops that were abandoned must not log "never retrieved".
        for msg in self._match.fail(exc):
            self._deliver(msg)
        if not self._match.keeping:
            self._copies.fail(exc)
        # a record still being copied must not keep writing into a buffer whose receive
        # failed (or into storage of a message that can no longer complete): drop the rest
        self._cur_dest = None
        if sends:
            self._fail_sends(exc)

    def _settle_lost(self, exc: ConnectionLost) -> None:
        self._fail_pending(exc, sends=True)
        self._release()

    def _release(self) -> None:
        # Whatever is still pending can no longer complete: fail it, never leave it hanging.
        self._fail_pending(self._failed or ConnectionLost("the connection was closed locally",
                                                          orderly=True), sends=True)
        if self._fd >= 0:
            if self._reading:
                self._loop.remove_reader(self._fd)
                self._reading = False
            if self._writing:
                self._loop.remove_writer(self._fd)
                self._writing = False
            _discard_input(self._sock)
            self._sock.close()
            self._fd = -1
            self._cur = self._cur_msg = None  # (holds a view of the ring)
            self._rx_ring.release()
            self._tx_ring.release()
            self._mem.release()
            unmapped = _unmap_soon(self._loop, self._mm)
        else:
            unmapped = None
        if self._failed is None:
            self._failed = ConnectionLost("the connection was closed locally", orderly=True)
        if unmapped is not None:  # (wait_closed() returns once the segment is unmapped)
            unmapped.add_done_callback(lambda _: self._set_released())
        else:
            self._set_released()

    def _set_released(self) -> None:
        if not self._released.done():
            self._released.set_result(None)

    # ------------------------------------------------------------------ the loop side
    def _schedule(self) -> None:
        """Run :meth:`_service` on the next loop step (at most one call is queued)."""
        if not self._scheduled and self._fd >= 0:
            self._scheduled = True
            self._loop.call_soon(self._scheduled_service)

    def _scheduled_service(self) -> None:
        self._scheduled = False
        self._service()

    def _service(self) -> None:
        """Consume and send within the step budget, then ask to be woken (or come back)."""
        if self._fd < 0:
            return
        try:
            more = self._read(time.perf_counter_ns() + _IO_NS)
            if self._fd < 0:
                return
            if self._sendq and self._failed is None:
                self._flush()
            if more:
                self._schedule()
            elif self._parser.notice is not None or self._peer_eof:
                if not self._rx.pending():
                    self._peer_closed()
                else:
                    self._schedule()
            elif self._rx.arm():  # something came since we last looked
                self._schedule()
        except ProtocolError as exc:
            self._lost(ConnectionLost(f"{self.peer} broke the protocol: {exc}"))
        except Exception as exc:
            self._internal_error("serving", exc)

    def _on_readable(self) -> None:
        try:
            eof = False
            for _ in range(16):
                try:
                    data = self._sock.recv(1 << 12)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # reset: the peer is gone
                    eof = True
                    break
                if not data:
                    eof = True
                    break
                self._parser.feed(data)
                if len(data) < 1 << 12:
                    break
            if eof:
                self._eof()
            if self._fd >= 0:
                self._service()
        except ProtocolError as exc:
            self._lost(ConnectionLost(f"{self.peer} broke the protocol: {exc}"))
        except Exception as exc:
            self._internal_error("reading from", exc)

    def _eof(self) -> None:
        """The peer's end of the control socket is closed (its process may be gone)."""
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False
        self._peer_eof = True
        if self._closing:
            self._release()
        elif self._parser.notice is None:
            self._lost(ConnectionLost(f"{self.peer} closed the connection unexpectedly"))
        # else: an orderly close; _service reports it once the ring is drained

    def _peer_closed(self) -> None:
        """The peer's close frame (or end of file) came and its ring is drained."""
        if self._closing:
            if self._sent_close or self._peer_eof:
                self._release()
            return
        self._lost(ConnectionLost(f"{self.peer} closed the connection", orderly=True,
                                  notice=self._parser.notice or b""))

    # ------------------------------------------------------------------ writing
    def _flush(self) -> None:
        """Write queued messages into the ring for ``_IO_NS`` at most; when the ring is
        full, ask the peer to wake us once it freed room."""
        queue = self._sendq
        tx = self._tx
        part = self._part
        until = time.perf_counter_ns() + _IO_NS
        while queue:
            s = queue[0]
            pos = s.pos
            n = min(s.total - pos, part)
            view = s.view if n == s.total else s.view[pos:pos + n]
            if not tx.write(s.tag, s.total, pos, view, s.meta, s.pad):
                tx.want_room()
                if tx.fits(n, s.pad):
                    continue
                return  # the peer wakes us when it frees room
            if tx.consumer_wants_wake():
                self._wake()
            s.pos = pos + n
            if s.pos == s.total:
                queue.popleft()
                if not s.fut.done():
                    s.fut.set_result(None)
            if queue and time.perf_counter_ns() >= until:
                self._schedule()
                return
        tx.room_found()
        if self._close_out is not None and self._closing:
            self._send_close()

    def _wake(self) -> None:
        """Tell the peer to look at the rings (one byte on the control socket)."""
        try:
            self._sock.send(shmring.WAKE, socket.MSG_NOSIGNAL)
        except OSError:
            # Full: the peer has unread wake-ups, so it wakes anyway. Broken: the peer is
            # gone, and this end's reader is about to see its end of file.
            pass

    def _send_close(self) -> None:
        self._write_close()
        if self._close_out and not self._writing and self._fd >= 0:
            self._loop.add_writer(self._fd, self._on_writable)
            self._writing = True

    def _write_close(self) -> None:
        """Write (the rest of) the close frame without blocking; once it is out, half-close
        the socket and wait for the peer's close or end of file."""
        frame = self._close_out
        if frame is None or self._fd < 0:
            return
        try:
            n = self._sock.send(frame, socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = len(frame)  # the peer is gone: nothing more to tell it
        self._close_out = frame[n:]
        if self._close_out:
            return
        self._close_out = None
        self._sent_close = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        if self._writing:
            self._loop.remove_writer(self._fd)
            self._writing = False
        if self._peer_eof or (self._parser.notice is not None and not self._rx.pending()):
            self._release()

    def _on_writable(self) -> None:
        try:
            self._write_close()
        except Exception as exc:
            self._internal_error("closing the connection to", exc)

    # ------------------------------------------------------------------ reading
    def _read(self, until: int) -> bool:
        """Consume records until none is left (returns ``False``) or ``perf_counter_ns()``
        passes ``until`` (returns whether more is pending). A record's payload is copied
        in ``_COPY_SLICE`` pieces with the clock checked between them; a record left
        half-copied is finished on the next call."""
        rx = self._rx
        match = self._match
        while True:
            rec = self._cur
            if rec is None:
                rec = rx.peek()
                if rec is None:
                    return False
                placed, dest = match.place(rec.tag, rec.total, rec.offset, rec.length,
                                           rec.meta)
                if match.arrivals:  # a message that came before its receive: tell the owner
                    for early_tag, early_meta in match.arrivals:
                        self._notify_arrival(self._loop, early_tag, early_meta)
                    match.arrivals.clear()
                self._cur, self._cur_msg, self._cur_dest, self._cur_pos = rec, placed, dest, 0
            length = rec.length
            pos = self._cur_pos
            dest = self._cur_dest
            if length <= _COPY_SLICE:
                if dest is not None and length:
                    dest[:] = rec.payload
            else:
                while True:
                    end = min(pos + _COPY_SLICE, length)
                    if dest is not None:
                        dest[pos:end] = rec.payload[pos:end]
                    pos = end
                    if pos == length:
                        break
                    if time.perf_counter_ns() >= until:
                        self._cur_pos = pos
                        return True
            msg = self._cur_msg
            assert msg is not None
            self._cur = self._cur_msg = self._cur_dest = None
            rx.release()
            if rx.producer_wants_wake():
                self._wake()
            done = match.landed(msg, length)
            if done is not None:
                self._deliver(done)
            if time.perf_counter_ns() >= until:
                return rx.pending()



def _discard_input(sock: socket.socket) -> None:
    """Read and drop what is waiting (bounded, never blocks): a Unix socket closed with
    unread input makes the peer's next read fail with a reset instead of end of file."""
    try:
        for _ in range(64):
            if not sock.recv(1 << 16):
                return
    except OSError:
        return


def _peer_name(sock: socket.socket) -> str:
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return "shm peer"
    return f"shm peer (pid {pid})"


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_writer(fd, ready)
    try:
        await fut
    finally:
        loop.remove_writer(fd)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int,
                        fds: list[int] | None = None) -> bytes:
    """``n`` bytes from ``sock``; file descriptors that come with them are appended to
    ``fds`` (closed here when ``fds`` is ``None``)."""
    buf = bytearray()
    anc = socket.CMSG_SPACE(4 * 4)
    while len(buf) < n:
        try:
            data, ancdata, _flags, _addr = sock.recvmsg(n - len(buf), anc,
                                                        socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            await _readable(loop, sock)
            continue
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[:len(payload) - len(payload) % got.itemsize])
                for fd in got:
                    if fds is None:
                        os.close(fd)
                    else:
                        fds.append(fd)
        if not data:
            raise ConnectionResetError("connection closed during handshake")
        buf += data
    return bytes(buf)


async def _send_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes,
                    fd: int | None = None) -> None:
    """Send ``data`` (with ``fd`` attached to its first byte)."""
    view = memoryview(data)
    while view:
        try:
            if fd is not None:
                n = sock.sendmsg([view], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                           array.array("i", [fd]))])
                fd = None
            else:
                n = sock.send(view)
        except (BlockingIOError, InterruptedError):
            await _writable(loop, sock)
            continue
        view = view[n:]


def _claims(hello: bytes) -> bytes:
    return hello


def _ack_claims(hello: bytes, capacity: int, lane: int) -> bytes:
    return struct.pack("<QQ", capacity, lane) + hello


def _new_segment(layout: shmring.SegmentLayout) -> tuple[int, mmap.mmap]:
    """A sealed memfd of the layout's size, mapped, with its header written."""
    fd = os.memfd_create("acoll-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, layout.size)
        # reserve the pages now: memory that cannot be had is an error here, not a SIGBUS
        # in the middle of a copy later
        os.posix_fallocate(fd, 0, layout.size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mm = _map(fd, layout.size)
    except BaseException:
        os.close(fd)
        raise
    layout.write_header(memoryview(mm))
    return fd, mm


def _close_segment(made: tuple[int, mmap.mmap]) -> None:
    os.close(made[0])
    unmap(made[1])


def _unmap_soon(loop: asyncio.AbstractEventLoop, mm: mmap.mmap) -> asyncio.Future[None] | None:
    """Unmap ``mm`` (unless a view of it is still alive: then the collector does), on a
    worker thread while ``loop`` runs (munmap of a 32 MiB ring pair takes 12 ms); the
    thread's future, or None when it was done here."""
    if loop.is_running() and not loop.is_closed():
        try:
            return asyncio.wrap_future(submit(unmap, mm), loop=loop)
        except RuntimeError:  # (the pool is shut down: the interpreter is ending)
            pass
    unmap(mm)
    return None


def _map(fd: int, size: int) -> mmap.mmap:
    """``fd``'s first ``size`` bytes, mapped shared and faulted in (:func:`_populate`)."""
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    _populate(mm)
    return mm


_MADV_POPULATE_WRITE = 23  # (Linux 5.14)
_libc: ctypes.CDLL | None = None


def _populate(mm: mmap.mmap) -> bool:
    """Fault ``mm``'s pages in now, not in the first messages' copies; False where the
    kernel cannot (before Linux 5.14: they fault in on first use).

    Through ctypes, which lets go of the GIL for the call: Python 3.11's mmap() holds it
    while MAP_POPULATE faults the pages in (48 ms for a 32 MiB ring, found by review),
    and the loop's thread waited for it although this runs on a worker thread.
    """
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
        view = ctypes.c_char.from_buffer(mm)
        try:
            return int(_libc.madvise(ctypes.addressof(view), len(mm),
                                     _MADV_POPULATE_WRITE)) == 0
        finally:
            del view  # (an export of the mapping: it could not be closed while alive)
    except (OSError, AttributeError, TypeError, ValueError):
        return False


def _map_peer_segment(fd: int, capacity: int, lane: int) -> mmap.mmap:
    """Map the listener's segment after checking its size and seals.

    Raises:
        ProtocolError: wrong size, not sealed against resizing, or a bad header.
    """
    try:
        layout = shmring.SegmentLayout(capacity, lane)
    except ValueError as exc:
        raise ProtocolError(f"the listener announced a bad ring: {exc}") from None
    if capacity > _MAX_RING:
        raise ProtocolError(f"the listener announced a ring of {capacity} bytes")
    size = os.fstat(fd).st_size
    if size != layout.size:
        raise ProtocolError(f"shared segment of {size} bytes, expected {layout.size}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & _SEALS != _SEALS:
        raise ProtocolError("shared segment is not sealed against resizing")
    mm = _map(fd, size)
    try:
        # (the view released before any close: with it exported, the close would raise
        # BufferError over the named error; found by review)
        with memoryview(mm) as view:
            announced = shmring.SegmentLayout.read_header(view).lane == lane
        if not announced:
            raise ProtocolError("shared segment header disagrees with the announced lane")
    except BaseException:
        mm.close()
        raise
    return mm


def _map_and_close(fd: int, capacity: int, lane: int) -> mmap.mmap:
    try:
        return _map_peer_segment(fd, capacity, lane)
    finally:
        os.close(fd)


def _drop(sock: socket.socket, mm: mmap.mmap) -> None:
    """Close a handshake's socket and mapping after its connection could not be made
    (a view the failed constructor made may still hold the mapping: then it is unmapped
    when collected)."""
    sock.close()
    with contextlib.suppress(BufferError):
        mm.close()


class ShmListener(HandshakeListener):
    """Accepts authenticated shared-memory connections on an abstract Unix socket.

    Every accepted socket runs the exchange of :mod:`acoll._auth` (see the module doc)
    within ``ACOLL_PREAUTH_TIMEOUT``; at most ``ACOLL_PREAUTH_LIMIT`` sockets may be in it
    at once (the oldest is dropped for a newcomer). Segments are made only for
    authenticated connectors.
    """

    kind = "shm"

    def __init__(self, sock: socket.socket, handle: bytes, key: bytes, capacity: int,
                 handshake_timeout: float, lane: int = 0) -> None:
        self._sock = sock
        self.handle = handle
        self._key = key
        self._capacity = capacity
        self._lane = lane
        super().__init__(sock, handshake_timeout)

    async def _handshake(self, sock: socket.socket, _addr: object) -> None:
        loop = self._loop
        peer = _peer_name(sock)
        fd = -1
        mm: mmap.mmap | None = None
        deadline = self._handshake_deadline()
        try:
            nonce_a = _auth.new_nonce()
            await wait_for(_send_all(loop, sock, _CHAL.pack(_MAGIC, _VERSION, nonce_a)),
                                   self._left(deadline))
            head = await wait_for(_recv_exactly(loop, sock, _HS.size),
                                          self._left(deadline))
            magic, version, nonce_c, hello_len = _HS.unpack(head)
            if magic != _MAGIC or version != _VERSION:
                raise ProtocolError("not an acoll shared-memory connection")
            if hello_len > _MAX_HELLO:
                raise ProtocolError(f"hello of {hello_len} bytes")
            rest = await wait_for(
                _recv_exactly(loop, sock, hello_len + _auth.PROOF_SIZE), self._left(deadline))
            hello, proof = rest[:hello_len], rest[hello_len:]
            if not _auth.verify(proof, self._key, _auth.CONNECT, _CONTEXT, nonce_a, nonce_c,
                                _claims(hello)):
                with contextlib.suppress(OSError):
                    sock.send(_REFUSED)
                raise ProtocolError("the connector does not hold this job's key")
            try:
                layout = shmring.SegmentLayout(self._capacity, self._lane)
                # (reserving and faulting in the pages: 10 ms for the default ring, 60 ms
                # for 32 MiB; not on the loop's thread)
                made = await in_thread(lambda: _new_segment(layout), _close_segment)
                fd, mm = made
                capacity, lane = self._capacity, self._lane
            except OSError as exc:  # out of memory (or memfd refused): say so, no segment
                log.warning("cannot make a shared segment of %d bytes for %s: %s",
                            layout.size, peer, exc)
                capacity = lane = 0
            ack = _ACK.pack(_auth.prove(self._key, _auth.ACCEPT, _CONTEXT, nonce_a, nonce_c,
                                        _ack_claims(hello, capacity, lane)), capacity, lane)
            await wait_for(_send_all(loop, sock, ack, fd if fd >= 0 else None),
                                   self._left(deadline))
            if mm is None:
                sock.close()
                return
        except (OSError, asyncio.TimeoutError, ProtocolError) as exc:
            self._refusals.refused("refused shm connection from %s: %s", peer, exc)
            sock.close()
            if mm is not None:
                mm.close()
            return
        except BaseException:  # cancelled by close(), or dropped for a newer connection
            sock.close()
            if mm is not None:
                mm.close()
            raise
        finally:
            if fd >= 0:
                os.close(fd)  # the mapping (and the peer's copy of the fd) keep it alive
        assert mm is not None
        if self._closed:
            sock.close()
            mm.close()
            return
        try:
            conn = ShmConnection(sock, mm, 0, peer)
        except ProtocolError as exc:  # (the header, which the connector can write, changed)
            self._refusals.refused("refused shm connection from %s: %s", peer, exc)
            _drop(sock, mm)
            return
        self._offer(hello, conn)



class ShmTransport(Transport):
    """Shared memory between processes of one host (see the module doc)."""

    name = "shm"
    capabilities = Capability.SAME_HOST

    def __init__(self, *, key: bytes, ring_size: int | None = None,
                 timeout: float = 30.0, lane: int | None = None, nranks: int = 0) -> None:
        if len(key) < 16:
            raise ValueError("ShmTransport needs the job's authentication key")
        self.key = key
        self.capacity = RING_SIZE.resolve(ring_size)
        try:
            shmring.SegmentLayout(self.capacity)
        except ValueError as exc:
            from ..errors import InvalidUsage

            raise InvalidUsage(f"ACOLL_SHM_RING_SIZE: {exc}") from None
        if self.capacity > _MAX_RING:
            from ..errors import InvalidUsage

            raise InvalidUsage(f"ACOLL_SHM_RING_SIZE={self.capacity}: at most {_MAX_RING}")
        self.lane = LANE_MAX.resolve(lane)
        if self.lane == -1:
            self.lane = auto_lane(nranks)
        if nranks > (os.cpu_count() or 1):
            # The lane busy-polls: it needs a core per rank. Said in the handle, so that
            # every rank's decision rests on the same records.
            self.lane = 0
        if self.lane % 64 or not 0 <= self.lane <= shmring.MAX_LANE:
            from ..errors import InvalidUsage

            raise InvalidUsage(f"ACOLL_SHM_LANE_MAX={self.lane}: a multiple of 64 from 0 "
                               f"to {shmring.MAX_LANE}")
        self.timeout = timeout
        self.netns = _netns()

    def can_connect(self, mine: PeerInfo, theirs: PeerInfo) -> bool:
        if mine.same_process(theirs) or not mine.same_host(theirs):
            return False
        a = _parse_handle(mine.handles.get(self.name, b""))
        b = _parse_handle(theirs.handles.get(self.name, b""))
        return a is not None and b is not None and a[0] == b[0]

    async def listen(self) -> ShmListener:
        token = os.urandom(16)
        handle = _HANDLE.pack(_MAGIC, _VERSION, self.lane // 64, self.netns, token)
        parsed = _parse_handle(handle)
        assert parsed is not None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(parsed[1])
            sock.listen(socket.SOMAXCONN)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen for shared-memory connections: {exc}"
                                 ) from exc
        return ShmListener(sock, handle, self.key, self.capacity, self.timeout, self.lane)

    async def connect(self, handle: bytes, hello: bytes, deadline: float) -> ShmConnection:
        parsed = _parse_handle(handle)
        if parsed is None:
            raise ProtocolError("bad shm handle")
        netns, name = parsed
        if netns != self.netns:
            raise TransportError("the shm listener is in another network namespace")
        loop = asyncio.get_running_loop()
        for attempt in range(_EVICTED_RETRIES):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            _forkguard.hold(sock)
            sock.setblocking(False)
            try:
                await wait_until(loop.sock_connect(sock, name), deadline,
                                 "connecting to a shm listener")
                peer = _peer_name(sock)
                mm = await wait_until(self._authenticate(loop, sock, hello), deadline,
                                      f"handshake with {peer}")
            except Evicted:
                sock.close()
                log.info("shm connection dropped during its handshake; retrying (%d)",
                         attempt + 1)
                await asyncio.sleep(min(0.01 * 2 ** attempt, 0.5))
                continue
            except BaseException as exc:
                sock.close()
                if isinstance(exc, OSError) and not isinstance(exc, AcollError):
                    raise TransportError(f"cannot connect to a shm listener: {exc}") from exc
                raise
            try:
                return ShmConnection(sock, mm, 1, peer)
            except ProtocolError:  # (the header, which the listener can write, changed)
                _drop(sock, mm)
                raise
        raise TransportError("the shm listener kept dropping the handshake")

    async def _authenticate(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                            hello: bytes) -> mmap.mmap:
        """Connector side of the exchange (module doc): the peer's segment, mapped."""
        try:
            magic, version, nonce_a = _CHAL.unpack(await _recv_exactly(loop, sock,
                                                                       _CHAL.size))
        except ConnectionError:
            raise Evicted from None
        if magic != _MAGIC or version != _VERSION:
            raise ProtocolError("the listener is not an acoll shm listener")
        nonce_c = _auth.new_nonce()
        await _send_all(loop, sock, _HS.pack(_MAGIC, _VERSION, nonce_c, len(hello)) + hello
                        + _auth.prove(self.key, _auth.CONNECT, _CONTEXT, nonce_a, nonce_c,
                                      _claims(hello)))
        fds: list[int] = []
        try:
            try:
                ack = await _recv_exactly(loop, sock, _ACK.size, fds)
            except ConnectionError:
                raise Evicted from None
            proof, capacity, lane = _ACK.unpack(ack)
            if ack == _REFUSED:
                raise ProtocolError("the listener refused the connection: this rank does "
                                    "not hold the job's key")
            if not _auth.verify(proof, self.key, _auth.ACCEPT, _CONTEXT, nonce_a, nonce_c,
                                _ack_claims(hello, capacity, lane)):
                raise ProtocolError("the listener failed to prove it holds the job's key")
            if capacity == 0:
                raise TransportError("the shm listener could not allocate the shared segment "
                                     "(out of memory?); ACOLL_SHM_RING_SIZE sets its size")
            if len(fds) != 1:
                raise ProtocolError(f"the listener sent {len(fds)} descriptors, not one")
            # (the descriptor is the thread's to close, even if this task is cancelled)
            segment = fds.pop()
            return await in_thread(lambda: _map_and_close(segment, capacity, lane), unmap)
        finally:
            for fd in fds:
                os.close(fd)


def make_shm(*, timeout: float, key: bytes, nranks: int = 0) -> ShmTransport | None:
    """The shared-memory transport for :func:`~.select.select_transports`, or ``None``
    when ``ACOLL_SHM_DISABLE`` turns it off or it cannot run here (logged at INFO)."""
    if DISABLE.resolve():
        log.info("NET/SHM: disabled by ACOLL_SHM_DISABLE; ranks of other processes on this "
                 "host use the network")
        return None
    why = unsupported()
    if why:
        log.info("NET/SHM: not used (%s); ranks of other processes on this host use the "
                 "network", why)
        return None
    transport = ShmTransport(key=key, timeout=timeout, nranks=nranks)
    log.info("NET/SHM: shared memory for ranks in other processes of this host (rings of "
             "%d KiB per direction)", transport.capacity >> 10)
    return transport
