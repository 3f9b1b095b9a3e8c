"""Settings and logging.

Each setting is declared next to the code that uses it, as a :class:`Setting`. One resolver,
:meth:`Setting.resolve`, applies the precedence *explicit argument -> ``ACOLL_<NAME>``
environment variable -> default*, and logs the choice at ``ACOLL_DEBUG=INFO``.

Logging goes through the stdlib :mod:`logging` module under the ``acoll`` logger, with one
child per subsystem (``acoll.INIT``, ``acoll.BOOTSTRAP``, ``acoll.NET``, ``acoll.COLL``,
``acoll.ENV``). ``ACOLL_DEBUG`` attaches a stderr handler, as ``NCCL_DEBUG`` does:

* ``VERSION``: only the line ``acoll <version>``; ``WARN``: that and warnings; ``INFO``: also
  progress and every setting's resolved value; ``TRACE``: everything.
* ``1``/``true``/``yes``/``on`` mean ``INFO``; ``0``/``false``/``no``/``off`` or empty mean
  off. Any other value is treated as ``WARN`` and a warning says so (importing acoll never
  fails because of it).
* Whenever the handler is attached, ``acoll <version>`` is printed once per process (at
  import).

``ACOLL_DEBUG_SUBSYS`` (comma list, ``^`` prefix to exclude, ``ALL``) filters subsystems.
Applications that configure logging themselves can leave ``ACOLL_DEBUG`` unset.

Each setting's value is logged at INFO once per process (again only if it changes); repeated
resolutions of the same value are logged at TRACE.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import socket
import sys
from collections.abc import Callable
from typing import Generic, TypeVar

from ._version import __version__
from .errors import InvalidUsage

__all__ = ["Setting", "get_logger", "parse_bool", "parse_seconds"]

T = TypeVar("T")

TRACE = 5
logging.addLevelName(TRACE, "TRACE")
#: The level of the version line: shown at ``ACOLL_DEBUG=VERSION`` and every lower level.
VERSION = logging.WARNING + 5
logging.addLevelName(VERSION, "VERSION")
SUBSYSTEMS = ("INIT", "BOOTSTRAP", "NET", "COLL", "ENV", "P2P")
_LEVELS = {"WARN": logging.WARNING, "WARNING": logging.WARNING, "INFO": logging.INFO,
           "TRACE": TRACE, "DEBUG": logging.DEBUG, "VERSION": VERSION,
           "1": logging.INFO, "TRUE": logging.INFO, "YES": logging.INFO, "ON": logging.INFO}
_OFF = ("", "0", "FALSE", "NO", "OFF")
_version_logged = False


def get_logger(subsys: str) -> logging.Logger:
    """Return the logger of one subsystem (``INIT``, ``BOOTSTRAP``, ``NET``, ``COLL``...)."""
    return logging.getLogger(f"acoll.{subsys}")


class _SubsysFilter(logging.Filter):
    def __init__(self, spec: str) -> None:
        super().__init__()
        spec = spec.strip().upper()
        self.exclude = spec.startswith("^")
        names = {s.strip() for s in spec.lstrip("^").split(",") if s.strip()}
        self.names = names or {"ALL"}

    def filter(self, record: logging.LogRecord) -> bool:
        sub = record.name.rpartition(".")[2]
        hit = "ALL" in self.names or sub in self.names
        return not hit if self.exclude else hit


def debug_level(text: str | None) -> tuple[int | None, bool]:
    """``(level, known)`` for an ``ACOLL_DEBUG`` value; level ``None`` means off.

    Unknown text gives ``(logging.WARNING, False)``; never raises.
    """
    key = (text or "").strip().upper()
    if key in _OFF:
        return None, True
    level = _LEVELS.get(key)
    return (logging.WARNING, False) if level is None else (level, True)


def configure_logging(environ: dict[str, str] | None = None) -> None:
    """Attach acoll's stderr handler according to ``ACOLL_DEBUG``/``ACOLL_DEBUG_SUBSYS``.

    Never raises on bad values (see the module doc); prints ``acoll <version>`` once per
    process when the handler is attached.
    """
    global _version_logged
    env = os.environ if environ is None else environ
    text = env.get("ACOLL_DEBUG", "")
    root = logging.getLogger("acoll")
    ours = [h for h in root.handlers if getattr(h, "_acoll", False)]
    for h in ours:
        root.removeHandler(h)
    level, known = debug_level(text)
    if level is None:
        if ours:
            root.setLevel(logging.NOTSET)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler._acoll = True  # type: ignore[attr-defined]
    host = socket.gethostname().split(".")[0]
    handler.setFormatter(logging.Formatter(
        f"{host}:%(process)d:%(threadName)s [acoll] %(name)s %(levelname)s %(message)s"))
    handler.addFilter(_SubsysFilter(env.get("ACOLL_DEBUG_SUBSYS", "ALL")))
    root.addHandler(handler)
    root.setLevel(level)
    if not _version_logged:
        _version_logged = True
        get_logger("INIT").log(VERSION, "acoll %s", __version__)
    if not known:
        get_logger("ENV").warning("ACOLL_DEBUG=%r is not one of VERSION, WARN, INFO, TRACE "
                                  "(or 1/0); using WARN", text.strip())


def parse_bool(text: str) -> bool:
    """Parse ``1/0``, ``true/false``, ``yes/no``, ``on/off``."""
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_seconds(text: str) -> float:
    """Parse a positive number of seconds."""
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0 seconds, got {text!r}")
    return value


def seconds_argument(value: object, name: str = "timeout") -> float:
    """``value`` as a positive number of seconds (``inf``: no deadline).

    Raises:
        InvalidUsage: ``value`` is not a real number (bool excluded; NumPy scalars are
            fine), or not > 0 (NaN included).
    """
    # (numbers.Real: NumPy's integer and float scalars too)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            float(value) > 0):
        raise InvalidUsage(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _number(x: float) -> str:
    """``x`` for a message: whole numbers in full (2147483647, not 2.14748e+09)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def parse_size(text: str) -> int:
    """Parse a byte size such as ``4096``, ``64K``, ``8M``, ``1G`` (a whole number of
    bytes; ``1.5K`` is 1536)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    value = float(t[:-1] if mult > 1 else t) * mult
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


class Setting(Generic[T]):
    """One tunable, read as argument -> ``ACOLL_<name>`` -> default.

    Args:
        name: the name without the ``ACOLL_`` prefix.
        parse: turns the environment text into a value; raises ``ValueError`` when invalid.
        default: the value when neither an argument nor the environment gives one.
        doc: one line describing the setting (shown in the README's settings table).
        subsys: the logging subsystem the resolution is reported under.
        lo, hi: the range a number from the environment must lie in (else InvalidUsage
            naming the variable).
    """

    registry: dict[str, Setting[object]] = {}
    #: name -> (origin, repr(value)) last logged at INFO (settings are logged once each).
    logged: dict[str, tuple[str, str]] = {}

    def __init__(self, name: str, parse: Callable[[str], T], default: T, doc: str,
                 subsys: str = "ENV", *, lo: float | None = None,
                 hi: float | None = None) -> None:
        self.name = name
        self.lo, self.hi = lo, hi
        self.env_name = f"ACOLL_{name}"
        self.parse = parse
        self.default = default
        self.doc = doc
        self.subsys = subsys
        Setting.registry[name] = self  # type: ignore[assignment]

    def raw(self) -> str | None:
        """The environment text, or ``None`` when the variable is unset, empty or blank."""
        text = os.environ.get(self.env_name)
        return text if text and not text.isspace() else None

    def resolve(self, value: T | None = None) -> T:
        """Return the effective value and log where it came from.

        Raises:
            InvalidUsage: the environment variable holds text ``parse`` rejects.
        """
        if value is not None:
            self._log(value, "argument")
            return value
        text = self.raw()
        if text is not None:
            try:
                parsed = self.parse(text)
            except (ValueError, TypeError, ArithmeticError) as exc:
                raise InvalidUsage(f"{self.env_name}={text!r} is invalid: {exc}") from exc
            self._check_range(parsed, text)
            self._log(parsed, "environment")
            return parsed
        self._log(self.default, "default")
        return self.default

    def _check_range(self, value: object, text: str) -> None:
        if (self.lo is None and self.hi is None) or not isinstance(value, (int, float)):
            return
        lo = -math.inf if self.lo is None else self.lo
        hi = math.inf if self.hi is None else self.hi
        if not lo <= value <= hi:  # (NaN fails too)
            where = (f"at least {_number(lo)}" if self.hi is None else
                     f"at most {_number(hi)}" if self.lo is None else
                     f"from {_number(lo)} to {_number(hi)}")
            raise InvalidUsage(f"{self.env_name}={text!r} is out of range: it must be {where}")

    def _log(self, value: object, origin: str) -> None:
        """INFO the first time (and when the value or its origin changes), TRACE after."""
        key = (origin, repr(value))
        first = Setting.logged.get(self.name) != key
        if first:
            Setting.logged[self.name] = key
        get_logger(self.subsys).log(logging.INFO if first else TRACE, "%s = %r (%s)",
                                    self.env_name, value, origin)


TIMEOUT = Setting("TIMEOUT", parse_seconds, 300.0,
                  "Deadline in seconds for every network wait (bootstrap and collectives).",
                  "INIT")

configure_logging()
