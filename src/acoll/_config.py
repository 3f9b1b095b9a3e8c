"""Settings and logging.

Each setting is declared next to the code that uses it, as a :class:`Setting`. One resolver,
:meth:`Setting.resolve`, applies the precedence *explicit argument -> ``ACOLL_<NAME>``
environment variable -> default*, and logs the choice at ``ACOLL_DEBUG=INFO``.

Logging goes through the stdlib :mod:`logging` module under the ``acoll`` logger, with one
child per subsystem (``acoll.INIT``, ``acoll.BOOTSTRAP``, ``acoll.NET``, ``acoll.COLL``,
``acoll.ENV``). ``ACOLL_DEBUG`` (``WARN``, ``INFO``, ``TRACE``) attaches a stderr handler;
``ACOLL_DEBUG_SUBSYS`` (comma list, ``^`` prefix to exclude, ``ALL``) filters subsystems.
Applications that configure logging themselves can leave ``ACOLL_DEBUG`` unset.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Generic, TypeVar

from .errors import InvalidUsage

__all__ = ["Setting", "get_logger", "parse_bool", "parse_seconds"]

T = TypeVar("T")

TRACE = 5
logging.addLevelName(TRACE, "TRACE")
SUBSYSTEMS = ("INIT", "BOOTSTRAP", "NET", "COLL", "ENV", "P2P")
_LEVELS = {"WARN": logging.WARNING, "WARNING": logging.WARNING, "INFO": logging.INFO,
           "TRACE": TRACE, "DEBUG": logging.DEBUG, "VERSION": logging.WARNING}


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


def configure_logging(environ: dict[str, str] | None = None) -> None:
    """Attach acoll's stderr handler according to ``ACOLL_DEBUG``/``ACOLL_DEBUG_SUBSYS``."""
    env = os.environ if environ is None else environ
    level_name = env.get("ACOLL_DEBUG", "").strip().upper()
    root = logging.getLogger("acoll")
    for h in list(root.handlers):
        if getattr(h, "_acoll", False):
            root.removeHandler(h)
    if not level_name:
        return
    level = _LEVELS.get(level_name)
    if level is None:
        raise InvalidUsage(f"ACOLL_DEBUG={level_name!r}: expected one of WARN, INFO, TRACE")
    handler = logging.StreamHandler(sys.stderr)
    handler._acoll = True  # type: ignore[attr-defined]
    host = socket.gethostname().split(".")[0]
    handler.setFormatter(logging.Formatter(
        f"{host}:%(process)d:%(threadName)s [acoll] %(name)s %(levelname)s %(message)s"))
    handler.addFilter(_SubsysFilter(env.get("ACOLL_DEBUG_SUBSYS", "ALL")))
    root.addHandler(handler)
    root.setLevel(level)


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


def parse_size(text: str) -> int:
    """Parse a byte size such as ``4096``, ``64K``, ``8M``, ``1G``."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


class Setting(Generic[T]):
    """One tunable, read as argument -> ``ACOLL_<name>`` -> default.

    Args:
        name: the name without the ``ACOLL_`` prefix.
        parse: turns the environment text into a value; raises ``ValueError`` when invalid.
        default: the value when neither an argument nor the environment gives one.
        doc: one line describing the setting (shown in the README's settings table).
        subsys: the logging subsystem the resolution is reported under.
    """

    registry: dict[str, Setting[object]] = {}

    def __init__(self, name: str, parse: Callable[[str], T], default: T, doc: str,
                 subsys: str = "ENV") -> None:
        self.name = name
        self.env_name = f"ACOLL_{name}"
        self.parse = parse
        self.default = default
        self.doc = doc
        self.subsys = subsys
        Setting.registry[name] = self  # type: ignore[assignment]

    def raw(self) -> str | None:
        """The environment text, or ``None`` when the variable is unset or empty."""
        text = os.environ.get(self.env_name)
        return text if text else None

    def resolve(self, value: T | None = None) -> T:
        """Return the effective value and log where it came from.

        Raises:
            InvalidUsage: the environment variable holds text ``parse`` rejects.
        """
        log = get_logger(self.subsys)
        if value is not None:
            log.info("%s = %r (argument)", self.env_name, value)
            return value
        text = self.raw()
        if text is not None:
            try:
                parsed = self.parse(text)
            except (ValueError, TypeError) as exc:
                raise InvalidUsage(f"{self.env_name}={text!r} is invalid: {exc}") from exc
            log.info("%s = %r (environment)", self.env_name, parsed)
            return parsed
        log.debug("%s = %r (default)", self.env_name, self.default)
        return self.default


TIMEOUT = Setting("TIMEOUT", parse_seconds, 300.0,
                  "Deadline in seconds for every network wait (bootstrap and collectives).",
                  "INIT")

configure_logging()
