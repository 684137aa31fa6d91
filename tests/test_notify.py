"""sd_notify (daemon/notify.py) against a real datagram socket, and logging (daemon/logs.py)."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from daemon import logs
from daemon.notify import Notifier, socket_address, watchdog_interval

ROOT = Path(__file__).resolve().parents[1]


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


# logging


@pytest.fixture
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    logs.set_level("info")
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def test_json_lines_and_runtime_level(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure_logging("info", "json", stream=out)
    log = logs.get_logger("adaspec.test")
    log.debug("hidden")
    log.info("hello", k=4)
    logs.set_level("warning")
    log.info("hidden too")
    log.warning("careful")
    logs.set_level("debug")
    log.debug("now visible")
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")

    events = json_lines(out.getvalue())
    assert [event["event"] for event in events] == ["hello", "careful", "now visible", "failed"]
    assert [event["level"] for event in events] == ["info", "warning", "debug", "error"]
    assert all(event["logger"] == "adaspec.test" for event in events)
    assert events[0]["k"] == 4
    stamp = str(events[0]["timestamp"])
    assert stamp.startswith("20") and "T" in stamp and stamp.endswith("Z")
    assert "ValueError: bad" in str(events[3]["exception"])
    assert logs.get_level() == "debug"


def test_reconfiguring_switches_the_format_of_cached_loggers(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure_logging("info", "json", stream=out)
    log = logs.get_logger("adaspec.test")
    direct = structlog.get_logger("adaspec.direct")  # as modules that import structlog do
    log.info("first")
    direct.info("direct")
    logs.configure_logging("debug", "console", stream=out)
    log.debug("second")
    first, direct_line, second = out.getvalue().splitlines()
    assert json.loads(first)["event"] == "first"
    assert json.loads(direct_line)["logger"] == "adaspec.direct"
    assert "second" in second and not second.startswith("{")


def test_stdlib_records_share_the_format_and_level(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure_logging("warning", "json", stream=out)
    logging.getLogger("watchfiles.main").info("hidden")
    logging.getLogger("watchfiles.main").warning("rust notify timeout %d", 5)
    (event,) = json_lines(out.getvalue())
    assert event["event"] == "rust notify timeout 5"
    assert event["logger"] == "watchfiles.main" and event["level"] == "warning" and "timestamp" in event


def test_console_format_and_bad_settings(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure_logging("info", "console", stream=out)
    logs.get_logger("adaspec.test").info("hello", k=4)
    text = out.getvalue()
    assert "hello" in text and "k=4" in text and not text.startswith("{")
    with pytest.raises(ValueError, match="log level"):
        logs.set_level("loud")
    with pytest.raises(ValueError, match="log format"):
        logs.configure_logging("info", "xml", stream=out)


def test_journal_priority_prefix(restore_logging: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(tmp_path / "journal", "w+") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        logs.configure_logging("info", "auto", stream=stream)
        logs.get_logger("adaspec.test").error("broken")
        stream.flush()
        stream.seek(0)
        line = stream.read().strip()
    assert line.startswith("<3>{")
    assert json.loads(line[3:])["event"] == "broken"


def test_auto_format_writes_json_to_a_non_tty_stderr() -> None:
    code = (
        "from daemon.logs import configure_logging, get_logger, set_level\n"
        "configure_logging()\n"
        "log = get_logger('adaspec.sub')\n"
        "log.info('one', n=1)\n"
        "log.debug('no')\n"
        "set_level('debug')\n"
        "log.debug('two')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout == ""
    events = json_lines(done.stderr)
    assert [(event["event"], event["level"], event["logger"]) for event in events] == [
        ("one", "info", "adaspec.sub"),
        ("two", "debug", "adaspec.sub"),
    ]
