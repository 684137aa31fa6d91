"""sd_notify (daemon/notify.py) against a real datagram socket."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from daemon.notify import Notifier, socket_address, watchdog_interval


@pytest.fixture
def short_dir(tmp_path: Path) -> Iterator[Path]:
    if len(os.fsencode(tmp_path)) <= 90:
        yield tmp_path
        return
    made = Path(tempfile.mkdtemp(prefix="as-", dir="/tmp"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def systemd(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """What systemd does: bind a datagram socket and name it in $NOTIFY_SOCKET."""
    path = short_dir / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def received(sock: socket.socket) -> dict[str, str]:
    return dict(line.split("=", 1) for line in sock.recv(4096).decode().split("\n"))


def test_messages_are_exact_datagrams(systemd: socket.socket) -> None:
    with Notifier() as notifier:
        assert notifier.enabled
        assert notifier.ready() is True
        assert systemd.recv(4096) == b"READY=1"
        notifier.status("serving: k=4, 3 requests")
        assert systemd.recv(4096) == b"STATUS=serving: k=4, 3 requests"
        notifier.status("two\nlines")
        assert systemd.recv(4096) == b"STATUS=two lines"
        notifier.watchdog()
        assert systemd.recv(4096) == b"WATCHDOG=1"
        notifier.stopping()
        assert systemd.recv(4096) == b"STOPPING=1"
        notifier.extend_timeout(2.5)
        assert systemd.recv(4096) == b"EXTEND_TIMEOUT_USEC=2500000"
        notifier.send(STATUS="loading", errno=5, ready=True)
        assert systemd.recv(4096) == b"STATUS=loading\nERRNO=5\nREADY=1"


def test_reloading_carries_a_current_monotonic_timestamp(systemd: socket.socket) -> None:
    notifier = Notifier()
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    fields = received(systemd)
    assert list(fields) == ["RELOADING", "MONOTONIC_USEC"]
    assert fields["RELOADING"] == "1"
    assert before <= int(fields["MONOTONIC_USEC"]) <= after
    notifier.close()


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"adaspec-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        with Notifier() as notifier:
            notifier.ready()
        assert sock.recv(4096) == b"READY=1"


def test_noop_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    notifier = Notifier()
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.reloading() is False
    assert notifier.status("x") is False
    assert notifier.watchdog_interval() is None
    assert Notifier("").enabled is False


def test_socket_address_syntax() -> None:
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@abstract") == "\0abstract"
    assert socket_address("relative/path") is None
    assert socket_address("") is None
    assert socket_address(None) is None


def test_send_failure_is_logged_once_and_never_raised(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(short_dir / "gone.sock"))
    notifier = Notifier()
    with capture_logs() as captured:
        assert notifier.ready() is False
        assert notifier.watchdog() is False
        assert notifier.watchdog() is False
    failures = [entry for entry in captured if entry["event"] == "sd_notify failed"]
    assert len(failures) == 1 and failures[0]["log_level"] == "warning"

    # once the socket is back, messages flow again (and that is said once)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(short_dir / "gone.sock"))
        sock.settimeout(5)
        with capture_logs() as captured:
            assert notifier.watchdog() is True
        assert sock.recv(4096) == b"WATCHDOG=1"
        assert [entry["event"] for entry in captured] == ["sd_notify works again"]
    notifier.close()


def test_watchdog_interval(systemd: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    pid = str(os.getpid())
    assert watchdog_interval({"WATCHDOG_USEC": "20000000"}) == 10.0
    assert watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": pid}) == 1.5
    assert watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "x"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval({}) is None

    monkeypatch.setenv("WATCHDOG_USEC", "500000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval() == 0.25
    assert Notifier().watchdog_interval() == 0.25
