"""acoll: collective communication for asyncio (what NCCL is to CUDA, for async Python).

Quick start::

    uid = acoll.get_unique_id()                  # on one rank; send bytes(uid) to the others
    comm = await acoll.init_rank(nranks, uid, rank)
    await comm.all_reduce(array)                 # in place, SUM
    await comm.close()
"""

from __future__ import annotations

from . import errors
from ._communicator import Communicator, Registration, get_unique_id, group, init_rank
from ._dtypes import AVG, MAX, MIN, PROD, SUM, ReduceOp
from ._env import init_from_env
from ._exitreport import install as _install_exit_report
from ._memory.shared import empty_shared
from ._uid import UniqueId
from ._version import __version__ as __version__
from .errors import (
                     AcollError,
                     BootstrapError,
                     ClosedError,
                     InvalidUsage,
                     ProtocolError,
                     RemoteError,
                     TimeoutError,
                     TransportError,
)

_install_exit_report()

__all__ = [
    "AVG",
    "MAX",
    "MIN",
    "PROD",
    "SUM",
    "AcollError",
    "BootstrapError",
    "ClosedError",
    "Communicator",
    "InvalidUsage",
    "ProtocolError",
    "ReduceOp",
    "Registration",
    "RemoteError",
    "TimeoutError",
    "TransportError",
    "UniqueId",
    "empty_shared",
    "errors",
    "get_unique_id",
    "group",
    "init_from_env",
    "init_rank",
]
