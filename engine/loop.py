"""The engine thread: calls `Controller.step()` while there is work, applies control messages
between steps (also while idle), and hands each request's tokens to whoever submitted it.

Everything here is thread-safe from the outside: `submit`, `cancel`, `drain` and `stop` may be
called from any thread (the daemon's event loop); the engine itself is only touched by `run`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from engine.controller import Controller
from engine.core import SequenceOutput, StepResult
from engine.request import Request

log = structlog.get_logger("adaspec.engine")

OutputCallback = Callable[[SequenceOutput], None]
StepObserver = Callable[[StepResult], None]


@dataclass
class LoopStats:
    rounds: int = 0
    tokens: int = 0
    verified: int = 0
    accepted: int = 0
    tokens_per_s: float = 0.0  # smoothed over recent busy time

    @property
    def mean_accepted_drafts(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0


class EngineLoop:
    def __init__(self, controller: Controller, idle_wait: float = 0.05, on_step: StepObserver | None = None) -> None:
        self.controller = controller
        self.on_step = on_step  # called on the engine thread with every StepResult (metrics)
        self.engine = controller.engine
        self.idle_wait = idle_wait
        self.stats = LoopStats()
        self.heartbeat = time.monotonic()
        self._callbacks: dict[str, OutputCallback] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._draining = False
        self.error: BaseException | None = None

    # ---- any thread -----------------------------------------------------------------------

    def submit(self, request: Request, on_output: OutputCallback) -> None:
        """Queue a request; `on_output` is called on the engine thread with each step's tokens."""
        with self._lock:
            if self._draining:
                raise RuntimeError("the engine is draining and admits no new requests")
            self._callbacks[request.id] = on_output
        try:
            self.engine.add_request(request)
        except ValueError:
            with self._lock:
                self._callbacks.pop(request.id, None)
            raise
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self._wake.set()

    def wake(self) -> None:
        """Have control messages applied now even if no request is running."""
        self._wake.set()

    def drain(self) -> None:
        """Stop admitting; requests already submitted run to completion."""
        with self._lock:
            self._draining = True

    @property
    def draining(self) -> bool:
        with self._lock:
            return self._draining

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._callbacks)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                if not self.engine.has_work:
                    self.controller.apply_pending()
                    self._wake.wait(self.idle_wait)
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as err:  # the daemon reports it and exits non-zero
            self.error = err
            log.exception("engine thread failed")
            raise

    def _step(self) -> None:
        started = time.perf_counter()
        result = self.controller.step()
        seconds = time.perf_counter() - started
        if self.on_step is not None:  # before the callbacks: a client that has its tokens sees them counted
            try:
                self.on_step(result)
            except Exception:
                log.exception("step observer failed")
        tokens = 0
        for out in result.outputs:
            tokens += len(out.new_tokens)
            if out.verified:
                self.stats.verified += 1
                self.stats.accepted += out.drafts_accepted
            with self._lock:
                callback = (
                    self._callbacks.pop(out.request_id, None)
                    if out.finish_reason is not None
                    else self._callbacks.get(out.request_id)
                )
            if callback is not None:
                try:
                    callback(out)
                except Exception:
                    log.exception("output callback failed", request_id=out.request_id)
        self.stats.rounds += 1
        self.stats.tokens += tokens
        if seconds > 0:
            rate = tokens / seconds
            self.stats.tokens_per_s = rate if self.stats.rounds == 1 else 0.95 * self.stats.tokens_per_s + 0.05 * rate
