"""Logging (control/logs.py): JSON lines or console, levels changed at run time, journald."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from control import logs

ROOT = Path(__file__).resolve().parents[1]


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


def test_without_a_stream_events_go_to_stderr_as_it_is_when_written(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logs.configure_logging("info", "json")
    log = logs.get_logger("adaspec.swapped")
    log.info("one")
    monkeypatch.setattr(sys, "stderr", second)  # as a test harness does between tests
    first.close()
    log.info("two")  # the logger was kept on first use; its stream was not
    assert [line["event"] for line in json_lines(second.getvalue())] == ["two"]


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
    # asyncio's warning for writes to a connection whose client has gone says nothing an operator
    # can act on (the metrics count the request as a 499); its other warnings stay.
    logging.getLogger("asyncio").warning("socket.send() raised exception.")
    logging.getLogger("asyncio").warning("Executing %s took %.3f seconds", "<Task>", 0.2)
    event, slow = json_lines(out.getvalue())
    assert event["event"] == "rust notify timeout 5"
    assert event["logger"] == "watchfiles.main" and event["level"] == "warning" and "timestamp" in event
    assert slow["logger"] == "asyncio" and slow["event"].startswith("Executing <Task>")


def test_watchfiles_info_lines_only_at_debug(restore_logging: None) -> None:
    # "1 change detected" at info for every save of the config: noise, unless debugging.
    out = io.StringIO()
    watcher = logging.getLogger("watchfiles.main")
    logs.configure_logging("info", "json", stream=out)
    watcher.info("%d change%s detected", 1, "")
    watcher.warning("rust notify timeout %d", 5)
    logs.get_logger("adaspec.test").info("ours")
    assert [event["event"] for event in json_lines(out.getvalue())] == ["rust notify timeout 5", "ours"]

    out.seek(0)
    out.truncate()
    logs.set_level("debug")  # at run time, as a reloaded [logging] section sets it
    watcher.info("%d change%s detected", 1, "")
    watcher.debug("never: it names every change, a log file's too")
    assert [(event["event"], event["level"]) for event in json_lines(out.getvalue())] == [("1 change detected", "info")]

    out.seek(0)
    out.truncate()
    logs.configure_logging("error", "json", stream=out)
    watcher.warning("below error")
    logs.configure_logging("info", "json", stream=out)
    watcher.info("%d change%s detected", 2, "s")
    assert out.getvalue() == ""


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
        "from control.logs import configure_logging, get_logger, set_level\n"
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
