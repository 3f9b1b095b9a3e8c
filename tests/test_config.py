"""Tests of acoll._config: ACOLL_DEBUG handling, the version line, settings logging."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import acoll
from acoll._config import TRACE, VERSION, Setting, configure_logging, debug_level
from acoll._net.interfaces import find_interfaces

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_settings_log() -> Iterator[None]:
    """Forget which settings were logged, so that the next resolution logs at INFO."""
    saved = dict(Setting.logged)
    Setting.logged.clear()
    yield
    Setting.logged.clear()
    Setting.logged.update(saved)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    yield
    configure_logging()


def _import_acoll(debug: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACOLL_DEBUG")}
    env["ACOLL_DEBUG"] = debug
    return subprocess.run([sys.executable, "-c", "import acoll, acoll._config as c; "
                           "c.configure_logging(); print('imported')"],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(("text", "expect"), [
    ("", (None, True)), ("0", (None, True)), ("off", (None, True)),
    ("1", (logging.INFO, True)), ("true", (logging.INFO, True)),
    ("info", (logging.INFO, True)), ("WARN", (logging.WARNING, True)),
    ("TRACE", (TRACE, True)), ("version", (VERSION, True)),
    ("verbose", (logging.WARNING, False)), ("2", (logging.WARNING, False)),
])
def test_debug_levels(text: str, expect: tuple[int | None, bool]) -> None:
    assert debug_level(text) == expect


@pytest.mark.parametrize("value", ["1", "bogus"])
def test_import_never_fails_on_acoll_debug(value: str) -> None:
    res = _import_acoll(value)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "imported\n"
    assert res.stderr.count(f"acoll {acoll.__version__}") == 1
    if value == "bogus":
        assert "ACOLL_DEBUG='bogus' is not one of" in res.stderr


def test_version_is_printed_once_and_alone() -> None:
    res = _import_acoll("VERSION")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].endswith(f"[acoll] acoll.INIT VERSION acoll {acoll.__version__}")


def test_version_matches_pyproject() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    [version] = re.findall(r'(?m)^version = "([^"]+)"$', text)
    assert version == acoll.__version__


def test_unknown_debug_value_means_warn(restore_logging: None) -> None:
    configure_logging({"ACOLL_DEBUG": "loud"})
    assert logging.getLogger("acoll").level == logging.WARNING
    configure_logging({"ACOLL_DEBUG": "1"})
    assert logging.getLogger("acoll").level == logging.INFO
    configure_logging({})
    assert not [h for h in logging.getLogger("acoll").handlers if getattr(h, "_acoll", False)]


def test_defaults_are_logged_at_info_once(fresh_settings_log: None,
                                          monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    setting = Setting("TEST_ONLY_KNOB", int, 3, "a knob for this test")
    monkeypatch.delenv("ACOLL_TEST_ONLY_KNOB", raising=False)
    try:
        with caplog.at_level(TRACE, logger="acoll"):
            assert setting.resolve() == 3
            assert setting.resolve() == 3
            monkeypatch.setenv("ACOLL_TEST_ONLY_KNOB", "4")
            assert setting.resolve() == 4
            assert setting.resolve(5) == 5
    finally:
        del Setting.registry["TEST_ONLY_KNOB"]
    got = [(r.levelno, r.getMessage()) for r in caplog.records if "KNOB" in r.getMessage()]
    assert got == [
        (logging.INFO, "ACOLL_TEST_ONLY_KNOB = 3 (default)"),
        (TRACE, "ACOLL_TEST_ONLY_KNOB = 3 (default)"),
        (logging.INFO, "ACOLL_TEST_ONLY_KNOB = 4 (environment)"),
        (logging.INFO, "ACOLL_TEST_ONLY_KNOB = 5 (argument)"),
    ]


def test_socket_family_from_the_unique_id_is_not_an_argument(
        fresh_settings_log: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # init_rank passes the id's root family to find_interfaces; nobody passed an argument.
    monkeypatch.delenv("ACOLL_SOCKET_FAMILY", raising=False)
    uid = acoll.UniqueId.from_address("127.0.0.1:1")
    with caplog.at_level(logging.INFO, logger="acoll"):
        iface = find_interfaces("=lo", uid.family)[0]
    assert iface.family == socket.AF_INET
    text = caplog.text
    assert "ACOLL_SOCKET_FAMILY = None (default)" in text
    assert "ACOLL_SOCKET_FAMILY = <AddressFamily.AF_INET: 2> (argument)" not in text


def test_socket_family_setting_overridden_by_the_id_is_said(
        fresh_settings_log: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("ACOLL_SOCKET_FAMILY", "AF_INET6")
    with caplog.at_level(logging.INFO, logger="acoll"):
        find_interfaces("=lo", socket.AF_INET)
    assert "(environment)" in caplog.text
    assert "ACOLL_SOCKET_FAMILY=AF_INET6 not used: the caller needs AF_INET" in caplog.text


# Found by review (session 56): values that passed the parsers and then hung a job, blamed
# a peer, or escaped as a raw OverflowError/ValueError without naming the variable.
@pytest.mark.parametrize(("name", "text", "says"), [
    ("SOCKET_BUFSIZE", "2G", "out of range"),  # (setsockopt's TypeError in a task: a hang)
    ("SOCKET_BUFSIZE", "-1", "out of range"),
    ("PREAUTH_TIMEOUT", "0", "> 0 seconds"),  # (every connection refused: a hang)
    ("PREAUTH_TIMEOUT", "nan", "> 0 seconds"),
    ("SOCKET_MAX_EARLY", "-1", "out of range"),  # (blamed the peer for "breaking" it)
    ("SHM_MAX_EARLY", "-1", "out of range"),
    ("CONNECT_RETRIES", "0", "out of range"),  # ("the root kept closing connections")
    ("SPIN_US", "nan", "out of range"),  # (a raw ValueError later)
    ("SPIN_US", "inf", "out of range"),
    ("SPIN_US", "-5", "out of range"),
    ("CHUNK_SIZE", "inf", "whole number of bytes"),  # (a raw OverflowError)
    ("SHM_RING_SIZE", "1e400", "whole number of bytes"),
    ("SMALL_MSG", "1.5", "whole number of bytes"),  # (was 1 byte)
    ("NATIVE", "7", "out of range"),
    ("SOCKET_SPLIT", "5", "out of range"),
    ("IB_SL", "16", "out of range"),
    ("IB_RETRY_CNT", "8", "out of range"),
    ("PREAUTH_LIMIT", "0", "out of range"),
    ("RING_CHUNKS", "-1", "out of range"),  # (0 is allowed: always CHUNK_SIZE)
])
def test_a_bad_setting_is_named(monkeypatch: pytest.MonkeyPatch, name: str, text: str,
                                says: str) -> None:
    import acoll._communicator
    import acoll._transport.rdma.transport  # (every module that declares a setting)

    setting = Setting.registry[name]
    monkeypatch.setenv(setting.env_name, text)
    with pytest.raises(acoll.InvalidUsage, match=re.escape(setting.env_name)) as err:
        setting.resolve()
    assert says in str(err.value)


def test_in_range_and_blank_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACOLL_SOCKET_BUFSIZE", "4M")
    assert Setting.registry["SOCKET_BUFSIZE"].resolve() == 4 << 20
    monkeypatch.setenv("ACOLL_SMALL_MSG", "1.5K")
    assert Setting.registry["SMALL_MSG"].resolve() == 1536
    monkeypatch.setenv("ACOLL_CHECK", "  ")  # (blank is unset: the default, True)
    assert Setting.registry["CHECK"].resolve() is True
    monkeypatch.setenv("ACOLL_SPIN_US", "0")
    assert Setting.registry["SPIN_US"].resolve() == 0.0
