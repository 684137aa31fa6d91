"""Structured logging: JSON lines for machines, a console renderer for people.

Loggers are cached on first use for speed, so nothing that may change at runtime can be baked
into them: a processor reads the current level on every event, so `set_level` takes effect at
once, and every logger ends in one shared renderer object, so that calling `configure_logging`
again (a hot-reloaded [logging] section) switches the format of cached loggers too.

Records from the standard library's `logging` (asyncio, watchfiles, ...) go through the same
renderer, so stderr carries one format.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
FORMATS = ("auto", "json", "console")

# The filtering bound logger below maps exception() to "error", warn() to "warning" and
# fatal() to "critical", so these are all the method names that reach the processors.
_METHOD_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
# syslog priorities, for journald's "<N>" line prefix.
_PRIORITIES = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}

_level = logging.INFO


def level_number(level: str) -> int:
    """The numeric level for a name such as "info"; ValueError names the accepted ones."""
    try:
        return LEVELS[level.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LEVELS)}") from None


def set_level(level: str) -> None:
    """Change the minimum level at runtime, for structlog and standard-library loggers alike."""
    global _level
    _level = level_number(level)
    logging.getLogger().setLevel(_level)
    logging.getLogger("watchfiles").setLevel(_watchfiles_level(_level))


def _watchfiles_level(level: int) -> int:
    """watchfiles' loggers (watchfiles.main, ...) log "1 change detected" at info for every save of
    the config, which the reload's own line already reports: shown only at level debug. Their
    debug lines never: they name every change in the folders watched, a log file there included,
    so each would be a change that writes another."""
    return logging.INFO if level <= logging.DEBUG else max(level, logging.WARNING)


def get_level() -> str:
    return logging.getLevelName(_level).lower()


def get_logger(name: str) -> Any:
    """A structlog logger whose events carry `logger=name` (once `configure_logging` has run)."""
    # The name goes to the logger factory, not into the context: binding it here would build the
    # logger now, with whatever configuration exists at import time.
    return structlog.get_logger(name)


class _CurrentStderr:
    """sys.stderr as it is when an event is written (a test harness replaces it for a while)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


# One line at a time, whoever writes it: structlog's events and the standard library's records
# (uvicorn, watchfiles) come from several threads, and each writer's own lock would let a line of
# one land inside a line of the other. Reentrant: a handler's flush takes it again.
_WRITE = threading.RLock()


class _NamedLineLogger:
    """structlog's logger: each event one write of a whole line, under `_WRITE`."""

    def __init__(self, file: TextIO | _CurrentStderr, name: str) -> None:
        self._file = file
        self.name = name

    def msg(self, message: str) -> None:
        with _WRITE:
            self._file.write(message + "\n")
            self._file.flush()

    log = debug = info = warning = warn = error = err = critical = fatal = exception = failure = msg


class _NamedLineLoggerFactory:
    def __init__(self, file: TextIO | _CurrentStderr) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _NamedLineLogger:
        return _NamedLineLogger(self._file, str(args[0]) if args else "")


def _drop_below_level(_logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    if _METHOD_LEVELS.get(method_name, logging.CRITICAL) < _level:
        raise structlog.DropEvent
    return event_dict


def _add_logger_name(logger: WrappedLogger, _method_name: str, event_dict: EventDict) -> EventDict:
    name = getattr(logger, "name", "")
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


class _Render:
    """The last processor of every logger, structlog's and the standard library's alike.

    Cached loggers keep the processors they were built with; they all share this object, and a
    new format replaces the steps inside it.
    """

    def __init__(self) -> None:
        self._steps: tuple[Processor, ...] = (structlog.processors.JSONRenderer(),)

    def use(self, *steps: Processor) -> None:
        self._steps = steps

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> Any:
        steps = self._steps  # read once: a switch from another thread cannot mix two formats
        for step in steps[:-1]:
            event_dict = step(logger, method_name, event_dict)
        return steps[-1](logger, method_name, event_dict)


_RENDER = _Render()


class _JournalPriority:
    """Prefix each rendered line with "<N>" so that journald records the event's priority."""

    def __init__(self, renderer: Processor) -> None:
        self._renderer = renderer

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> Any:
        priority = _PRIORITIES.get(str(event_dict.get("level", "")), 6)
        return f"<{priority}>{self._renderer(logger, method_name, event_dict)}"


def _is_journal(stream: TextIO) -> bool:
    """True when `stream` is systemd's journal stream (it sets $JOURNAL_STREAM to "dev:inode")."""
    expected = os.environ.get("JOURNAL_STREAM")
    if not expected:
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (ValueError, AttributeError):
        return False


class _StdlibHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Our handler on the root logger, told apart so that reconfiguring replaces it; it writes a
    record's line in one write, under the lock structlog's events take (`_WRITE`)."""

    def createLock(self) -> None:
        self.lock = _WRITE

    def filter(self, record: logging.LogRecord) -> bool:
        # asyncio warns after a few writes to a connection whose client has gone, naming neither:
        # a stream its client left is already cancelled, and counted as a 499 in the metrics.
        if record.name == "asyncio" and record.msg == "socket.send() raised exception.":
            return False
        return super().filter(record)


def configure_logging(
    level: str = "info", fmt: str = "auto", *, stream: TextIO | None = None, cache: bool = True
) -> None:
    """Set up structlog (and route standard-library logging) to write to `stream` (stderr).

    `fmt` is "json", "console", or "auto": JSON unless the stream is a terminal. Call it before
    the first event is logged, and again whenever the level or format changes. Loggers cached
    before keep the stream of their first use, so keep the same stream when calling it again.
    With cache=False no logger is kept (each event builds its own, a few microseconds): for code
    that may run in a process whose logging is set up again later, as the benches are in tests.
    Without a stream, events go to sys.stderr as it is when each is written.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; expected one of {', '.join(FORMATS)}")
    set_level(level)
    out = sys.stderr if stream is None else stream
    target = _CurrentStderr() if stream is None else stream
    tty = _is_tty(out)
    as_json = fmt == "json" or (fmt == "auto" and not tty)

    renderer: Processor
    if as_json:
        tail: list[Processor] = [structlog.processors.format_exc_info]
        renderer = structlog.processors.JSONRenderer()
    else:
        tail = []  # ConsoleRenderer formats exc_info itself
        renderer = structlog.dev.ConsoleRenderer(colors=tty)
    if _is_journal(out):
        renderer = _JournalPriority(renderer)

    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    _RENDER.use(*tail, renderer)
    structlog.configure(
        processors=[
            _drop_below_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _add_logger_name,
            stamp,
            structlog.processors.StackInfoRenderer(),
            _RENDER,
        ],
        # NOTSET: every method reaches the processors, where _drop_below_level reads the level.
        wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
        logger_factory=_NamedLineLoggerFactory(target),
        cache_logger_on_first_use=cache,
    )

    handler = _StdlibHandler(target)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.processors.add_log_level, structlog.stdlib.add_logger_name, stamp],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _RENDER],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StdlibHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
