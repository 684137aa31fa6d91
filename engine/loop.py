"""The engine thread: one inbox in, a status snapshot out.

Other threads (the daemon's event loop) never touch the engine. They put typed commands in the
loop's inbox (submit, cancel, pin, unpin, force, new parameters, build a runtime state, stop);
the engine thread applies them between rounds, in order, and acknowledges each with the round
from which it holds. After every round and every command it publishes an `EngineStatus`, which
other threads read instead of the engine's own fields.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import structlog

from engine.controller import Ack, Controller, Force, Message, Pin, SetParams, Unpin
from engine.core import SequenceOutput, StepResult
from engine.policy import PolicyParams
from engine.request import Request

log = structlog.get_logger("adaspec.engine")

OutputCallback = Callable[[SequenceOutput], None]
StepObserver = Callable[[StepResult], None]


@dataclass(frozen=True)
class Submit:
    request: Request
    on_output: OutputCallback  # called on the engine thread with each round's tokens


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class CancelAll:
    """Every request in flight, queued or running (the drain deadline has passed)."""


@dataclass(frozen=True)
class BuildState:
    k: int


@dataclass(frozen=True)
class Stop:
    pass


Command = Submit | Cancel | CancelAll | BuildState | Stop | Message


@dataclass(frozen=True)
class StateInfo:
    k: int
    build_seconds: float
    memory_bytes: int
    round_seconds: dict[int, float]  # batch size -> a round's seconds, timed before serving


@dataclass(frozen=True)
class EngineStatus:
    """What the engine runs with, as of the last round or command applied."""

    k: int  # the draft length of the next round
    mode: str  # adaptive, pinned, forced or static
    pinned: int | None
    params: PolicyParams
    candidates: tuple[int, ...]  # those the policy chooses from now (with [[adaptive.slots]]: its slot's)
    ema: float | None  # the acceptance EMA where the strategy keeps one (ema)
    round: int
    switches: int
    running: int  # sequences in the batch
    states: tuple[StateInfo, ...]  # built runtime states, by k
    tokens: int = 0
    mean_accepted_drafts: float = 0.0
    tokens_per_s: float = 0.0  # smoothed over recent busy time
    threads: int | None = None  # the compiled CPU forward's threads next round (None: not chosen here)
    thread_switches: int = 0  # changes of the count served
    # draft length -> sequences' rounds at it (rows of one round differ with adaptive.per_sequence)
    sequence_rounds: dict[int, int] = field(default_factory=dict)


@dataclass
class LoopStats:
    rounds: int = 0
    tokens: int = 0
    verified: int = 0
    accepted: int = 0
    tokens_per_s: float = 0.0
    # draft length -> sequences' rounds that drafted it (rows of a round differ with per_sequence)
    sequence_rounds: Counter[int] = field(default_factory=Counter)

    @property
    def mean_accepted_drafts(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0


class EngineLoop:
    def __init__(self, controller: Controller, idle_wait: float = 0.05, on_step: StepObserver | None = None) -> None:
        self.controller = controller  # the engine thread's alone once `run` starts
        self.engine = controller.engine
        self.on_step = on_step  # called on the engine thread with every StepResult (metrics)
        self.idle_wait = idle_wait
        self.stats = LoopStats()
        self.heartbeat = time.monotonic()
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue[tuple[Command, Future[Ack]]] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}  # engine thread only
        self._lock = threading.Lock()  # guards the two fields below
        self._in_flight = 0
        self._draining = False
        self._stopped = False
        self._states: tuple[StateInfo, ...] = ()
        self.status = self._snapshot()

    # ---- any thread -----------------------------------------------------------------------

    def send(self, command: Command) -> Future[Ack]:
        """Queue a command for the engine thread; the future holds its acknowledgement, or the
        ValueError or KeyError that rejected it."""
        done: Future[Ack] = Future()
        self._inbox.put((command, done))
        return done

    def submit(self, request: Request, on_output: OutputCallback) -> Future[Ack]:
        """Queue a request; ValueError at once if the engine cannot serve it or is draining."""
        self.engine.check_request(request)
        with self._lock:
            if self._draining:
                raise RuntimeError("the engine is draining and admits no new requests")
            self._in_flight += 1
        return self.send(Submit(request, on_output))

    def cancel(self, request_id: str) -> Future[Ack]:
        return self.send(Cancel(request_id))

    def cancel_all(self) -> Future[Ack]:
        """End every request in flight at the next boundary: its last output says "cancelled"."""
        return self.send(CancelAll())

    def pin(self, k: int) -> Future[Ack]:
        return self.send(Pin(k))

    def unpin(self) -> Future[Ack]:
        return self.send(Unpin())

    def force(self, k: int) -> Future[Ack]:
        return self.send(Force(k))

    def set_params(self, params: PolicyParams, adaptive: bool = True, static_k: int | None = None) -> Future[Ack]:
        return self.send(SetParams(params, adaptive, static_k))

    def build_state(self, k: int) -> Future[Ack]:
        """Build the runtime state for k between rounds (a no-op where it exists)."""
        return self.send(BuildState(k))

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
        """Requests submitted and not finished (queued or running)."""
        with self._lock:
            return self._in_flight

    def stop(self) -> None:
        self.send(Stop())

    # ---- the engine thread ---------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._stopped:
                self.heartbeat = time.monotonic()
                self._apply_inbox(block=not self.engine.has_work)
                if self.engine.has_work and not self._stopped:
                    self._step()
                    self.status = self._snapshot()
        except BaseException as err:  # the daemon reports it and exits non-zero
            self.error = err
            log.exception("engine thread failed")
            raise

    def _apply_inbox(self, block: bool) -> None:
        """Apply every queued command; while idle, wait up to idle_wait for the first."""
        try:
            item = self._inbox.get(timeout=self.idle_wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            command, done = item
            try:
                done.set_result(self._apply(command))
            except (ValueError, KeyError) as err:
                done.set_exception(err)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        self.status = self._snapshot()

    def _apply(self, command: Command) -> Ack:
        match command:
            case Submit(request, on_output):
                # Checked at submit (`submit`): the engine thread only queues it.
                self._callbacks[request.id] = on_output
                self.engine.enqueue(request)
            case Cancel(request_id):
                if request_id in self._callbacks:
                    self.engine.cancel(request_id)
            case CancelAll():
                for request_id in self._callbacks:
                    self.engine.cancel(request_id)
            case BuildState(k):
                state = self.engine.build_state(k)
                log.info("runtime state built", k=state.k, build_seconds=round(state.build_seconds, 4))
            case Stop():
                self._stopped = True
            case SetParams() | Pin() | Unpin() | Force():
                return self.controller.apply(command)
        return self.controller.ack()

    def _finished(self, request_id: str) -> OutputCallback | None:
        callback = self._callbacks.pop(request_id, None)
        if callback is not None:
            with self._lock:
                self._in_flight -= 1
        return callback

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
                self.stats.sequence_rounds[out.drafts_proposed] += 1
            if out.finish_reason is not None:
                callback = self._finished(out.request_id)
            else:
                callback = self._callbacks.get(out.request_id)
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

    def _snapshot(self) -> EngineStatus:
        controller, engine, stats = self.controller, self.engine, self.stats
        if len(self._states) != len(engine.states):  # states are only ever added
            built = sorted(engine.states.values(), key=lambda s: s.k)
            self._states = tuple(StateInfo(s.k, s.build_seconds, s.memory_bytes, dict(s.round_seconds)) for s in built)
        return EngineStatus(
            k=controller.k,
            mode=controller.mode_name,
            pinned=controller.pinned,
            params=controller.params,
            candidates=tuple(controller.policy.candidates),
            ema=controller.policy.ema,
            round=engine.round,
            switches=controller.switches,
            running=len(engine.running),
            states=self._states,
            tokens=stats.tokens,
            mean_accepted_drafts=stats.mean_accepted_drafts,
            tokens_per_s=stats.tokens_per_s,
            threads=None if controller.threads is None else controller.threads.threads,
            thread_switches=0 if controller.threads is None else controller.threads.switches,
            sequence_rounds=dict(sorted(stats.sequence_rounds.items())),
        )
