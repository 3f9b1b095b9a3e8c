"""Fixed ports for tests that must name one before anything listens on it.

A port taken from the kernel (bind to 0, then release) may be handed to another test's
listener before ours binds it, and with pytest-xdist that other test runs at the same time.
So each worker draws from its own band below the kernel's ephemeral range (which the kernel
never hands out for port 0), and checks the port is free.
"""

from __future__ import annotations

import os
import random
import socket

_BAND = 2000
_BASE = 20000  # below Linux's default ephemeral range (32768-60999)


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 in this xdist worker's own band."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = _BASE + (index % 6) * _BAND
    for _ in range(200):
        port = random.randrange(low, low + _BAND)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in this worker's band")
