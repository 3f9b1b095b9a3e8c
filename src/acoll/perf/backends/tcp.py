"""The raw TCP ceiling: one full-duplex ring step over plain blocking sockets.

acoll's communicator still does set-up (address exchange), barriers and timing; only the
data moves over the sockets this backend connects.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from ..._communicator import Communicator
from ..._net.interfaces import find_interfaces
from ..colls import Coll
from .acoll import AcollBackend
from .base import Op, OpArgs

__all__ = ["TcpBackend"]


class _TcpRing:
    """Send to the successor (a thread) while receiving from the predecessor."""

    def __init__(self, to_next: socket.socket, from_prev: socket.socket) -> None:
        self.to_next, self.from_prev = to_next, from_prev
        self._jobs: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._sender, name="acoll-perf-tcp",
                                        daemon=True)
        self._thread.start()

    def _sender(self) -> None:
        while True:
            data = self._jobs.get()
            if data is None:
                return
            try:
                self.to_next.sendall(data)
                self._done.put(None)
            except BaseException as exc:  # handed to the caller
                self._done.put(exc)

    def exchange(self, send: npt.NDArray[Any], recv: npt.NDArray[Any]) -> None:
        """Send ``send`` and receive ``recv.nbytes`` bytes into ``recv``, concurrently."""
        self._jobs.put(send.view(np.uint8).data)
        view = recv.view(np.uint8).data
        got, total = 0, len(view)
        while got < total:
            n = self.from_prev.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("tcp: the predecessor closed the connection")
            got += n
        err = self._done.get()
        if err is not None:
            raise err

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self.to_next.close()
        self.from_prev.close()


class TcpBackend(AcollBackend):
    """Measures only the ``tcp`` collective, on host buffers; :meth:`open` connects the ring."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm)
        self.name = "tcp"
        self.info = {"backend": "raw TCP (blocking sockets, sender thread)",
                     "net": "tcp", "loop": self.info["loop"], "chunk": "-"}
        self.ring: _TcpRing | None = None

    async def open(self) -> None:
        """Connect to the ring successor and accept the predecessor (within comm.timeout)."""
        timeout = self.comm.timeout
        iface = find_interfaces()[0]
        lsock = socket.socket(iface.family, socket.SOCK_STREAM)
        try:
            lsock.bind(iface.sockaddr(0))
            lsock.listen(4)
            host, port = lsock.getsockname()[:2]
            mine = np.zeros(64, np.uint8)
            raw = f"{host}|{port}|{iface.scope_id}".encode()
            mine[:len(raw)] = np.frombuffer(raw, np.uint8)
            every = np.zeros(64 * self.size, np.uint8)
            await self.comm.all_gather(mine, every)
            nxt = (self.rank + 1) % self.size
            text = every[64 * nxt:64 * (nxt + 1)].tobytes().rstrip(b"\0").decode()
            h, p, scope = text.split("|")
            addr: tuple[Any, ...] = (h, int(p), 0, int(scope)) \
                if iface.family == socket.AF_INET6 else (h, int(p))

            def dial_and_accept() -> tuple[socket.socket, socket.socket]:
                out = socket.socket(iface.family, socket.SOCK_STREAM)
                out.settimeout(timeout)
                out.connect(addr)
                lsock.settimeout(timeout)
                inc, _ = lsock.accept()
                for s in (out, inc):
                    s.settimeout(timeout)
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return out, inc

            out, inc = await asyncio.to_thread(dial_and_accept)
        finally:
            lsock.close()
        self.ring = _TcpRing(out, inc)

    def make_op(self, coll: Coll, args: OpArgs) -> Op | None:
        ring = self.ring
        if ring is None:
            raise RuntimeError("TcpBackend.make_op before open()")
        inp, out = args.inp, args.out

        async def run() -> None:
            ring.exchange(inp, out)  # blocks the loop on purpose: nothing else runs meanwhile
        return run

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
