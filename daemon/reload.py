"""Config reloads: one path for file edits, SIGHUP and `adaspecctl reload`.

Read the file, hash it (an unchanged file is a no-op), validate it whole, diff it against the
running snapshot, apply the live sections ([adaptive] at the engine's next boundary, after any
missing runtime state is built by the engine thread between rounds; [logging] at once), and report the rest as
needing a restart. A rejected file changes nothing: the previous snapshot keeps running.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import anyio
import structlog

from control.assemble import required_k
from control.issues import ConfigError
from control.load import parse_config
from control.logs import configure_logging
from control.snapshot import ConfigSnapshot, diff
from daemon.notify import Notifier
from engine.loop import EngineLoop

log = structlog.get_logger("adaspec.reload")

APPLY_TIMEOUT_S = 30.0


def iso_time(epoch: float) -> str:
    """A `time.time()` value as ISO 8601 in UTC with its offset, to the millisecond
    ("2026-11-28T18:20:05.123+00:00"): what status and reload replies show for a moment."""
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class ReloadOutcome:
    ok: bool
    trigger: str
    generation: int
    at: float = field(default_factory=time.time)  # time.time(); shown as ISO 8601 (iso_time)
    errors: tuple[str, ...] = ()
    applied: tuple[str, ...] = ()  # live keys now in force
    restart_required: tuple[str, ...] = ()  # changed keys that only a restart applies
    unchanged: bool = False
    round: int | None = None  # the engine round from which the new [adaptive] section applies

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "trigger": self.trigger,
            "generation": self.generation,
            "at": iso_time(self.at),
            "errors": list(self.errors),
            "applied": list(self.applied),
            "restart_required": list(self.restart_required),
            "unchanged": self.unchanged,
            "round": self.round,
        }


class Reloader:
    def __init__(self, path: Path, snapshot: ConfigSnapshot, loop: EngineLoop, notifier: Notifier) -> None:
        self.path = path
        self.boot = snapshot  # what the restart-only sections are still running with
        self.snapshot = snapshot
        self.loop = loop
        self.notifier = notifier
        self.last = ReloadOutcome(ok=True, trigger="start", generation=snapshot.generation, at=snapshot.loaded_at)
        self.failures = 0
        self._lock = anyio.Lock()

    async def reload(self, trigger: str) -> ReloadOutcome:
        async with self._lock:
            self.notifier.reloading()
            try:
                outcome = await self._reload(trigger)
            finally:
                self.notifier.ready()
        if not outcome.unchanged or not self.last.ok or trigger != "watch":
            # A file edited back to the running config counts as a good reload: it clears the error.
            # An operator's SIGHUP or `adaspecctl reload` shows even when nothing changed; the
            # watcher's touches that change nothing do not hide the last real reload.
            self.last = outcome
        if outcome.ok:
            log.info("reload", **_fields(outcome))
            for warning in () if outcome.unchanged else self.snapshot.warnings:
                log.warning("config warning", warning=warning)
        else:
            self.failures += 1
            log.error("reload rejected", **_fields(outcome))
        return outcome

    async def _reload(self, trigger: str) -> ReloadOutcome:
        current = self.snapshot
        try:
            data = await anyio.Path(self.path).read_bytes()
        except FileNotFoundError:
            return self._rejected(trigger, f"{self.path}: the file is gone; generation {current.generation} stays")
        except OSError as err:
            return self._rejected(trigger, f"{self.path}: {err.strerror}")
        if hashlib.sha256(data).hexdigest() == current.sha256:
            return ReloadOutcome(
                ok=True,
                trigger=trigger,
                generation=current.generation,
                unchanged=True,
                restart_required=self.pending_restart(),
            )
        try:
            # Off the event loop: checking the models reads their headers and parses their tokenizer.
            check = partial(parse_config, data, path=self.path, generation=current.generation + 1, check_models=True)
            new = await anyio.to_thread.run_sync(check)
        except ConfigError as err:
            return self._rejected(trigger, *(str(issue) for issue in err.issues))

        engine = self.loop.engine
        too_big = [k for k in required_k(new) if k > engine.max_k]
        if too_big:
            return self._rejected(
                trigger,
                f"adaptive: draft lengths {too_big} exceed the running engine's max_k {engine.max_k} "
                "(raising engine.max_k needs a restart)",
            )
        changes = diff(current, new)
        round_applied = None
        if any(key.startswith("adaptive.") for key in changes.live):
            try:
                round_applied = await self._apply_adaptive(new)
            except ValueError as err:
                return self._rejected(trigger, f"adaptive: {err}")
        if any(key.startswith("logging.") for key in changes.live):
            configure_logging(new.logging.level, new.logging.format)
        self.snapshot = new
        return ReloadOutcome(
            ok=True,
            trigger=trigger,
            generation=new.generation,
            applied=changes.live,
            restart_required=self.pending_restart(),
            round=round_applied,
        )

    async def _apply_adaptive(self, new: ConfigSnapshot) -> int:
        built = {state.k for state in self.loop.status.states}
        for k in required_k(new):
            if k not in built:
                log.info("building runtime state", k=k)
                await anyio.to_thread.run_sync(self.loop.build_state(k).result, APPLY_TIMEOUT_S)
        if self.boot.engine.drafter == "none":
            return self.loop.status.round  # nothing to adapt without a drafter
        adaptive = new.adaptive
        done = self.loop.set_params(adaptive.policy, adaptive=adaptive.enabled, static_k=adaptive.static_k)
        ack = await anyio.to_thread.run_sync(done.result, APPLY_TIMEOUT_S)
        return ack.round

    def pending_restart(self) -> tuple[str, ...]:
        """Keys of the running config that only a restart applies, changed since the start."""
        return diff(self.boot, self.snapshot).restart

    def _rejected(self, trigger: str, *errors: str) -> ReloadOutcome:
        # The running config stays, and so does what of it waits for a restart.
        return ReloadOutcome(
            ok=False,
            trigger=trigger,
            generation=self.snapshot.generation,
            errors=errors,
            restart_required=self.pending_restart(),
        )


def _fields(outcome: ReloadOutcome) -> dict:
    return {k: v for k, v in outcome.as_dict().items() if v not in ((), [], None)}
