"""Start-up, phase by phase: each is logged with its duration as it ends, systemd is told how
much longer to wait before each, and `adaspecctl status` shows the one in progress."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

from daemon.notify import Notifier

log = structlog.get_logger("adaspec.daemon")

# What systemd is asked to wait for each phase beyond its TimeoutStartSec: loading a large
# checkpoint from a cold disk, or capturing graphs, can take a while.
PHASE_TIMEOUT_S = 120.0


class Startup:
    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.started = time.monotonic()
        self.done: list[tuple[str, float]] = []  # (phase, seconds), in order
        self.current: str | None = None
        self._lock = threading.Lock()  # phases run on a worker thread; status reads them from the loop

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.notifier.extend_timeout(PHASE_TIMEOUT_S)
        self.notifier.status(f"starting: {name}")
        with self._lock:
            self.current = name
        began = time.perf_counter()
        try:
            yield
        except Exception as err:
            log.error("startup phase failed", phase=name, error=f"{type(err).__name__}: {err}")
            raise
        seconds = time.perf_counter() - began
        with self._lock:
            self.done.append((name, seconds))
            self.current = None
        log.info("startup phase", phase=name, seconds=round(seconds, 3))

    def status(self) -> dict:
        with self._lock:
            return {
                "state": "starting",
                "phase": self.current,
                "phases_done": [{"phase": name, "seconds": round(s, 3)} for name, s in self.done],
                "starting_for_s": round(time.monotonic() - self.started, 3),
            }
