"""The admin commands behind the socket: status, pin, unpin, force, reload, config, help."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import anyio

from control.admin import AdminError, Peer
from control.bounded import clip
from control.snapshot import effective
from daemon.reload import Reloader, iso_time
from daemon.startup import Startup
from engine import parallel
from engine.controller import FORCE_NEEDS_ADAPTING, Ack
from engine.loop import EngineLoop

APPLY_TIMEOUT_S = 30.0

HELP = {
    "status": "current k, mode, strategy, EMA, round, config generation, last reload, runtime states, throughput",
    "pin": 'hold the draft length: {"k": K}; the policy keeps observing',
    "unpin": "let the policy choose again, from the candidate nearest the pinned k (with adaptation off: static_k)",
    "force": 'switch to {"k": K} at the next boundary, then adapt from there',
    "reload": "re-read the config file; replies with the new generation or every error",
    "config": "the effective configuration, each value marked default, file or admin",
    "help": "this list",
}


class AdminCommands:
    """Answers from the moment the daemon starts: while it loads, `status` names the start-up
    phase and other commands say it is starting; `serve` hands them the running engine."""

    def __init__(self, startup: Startup, started: float | None = None) -> None:
        self.startup = startup
        self.loop: EngineLoop | None = None
        self.reloader: Reloader | None = None
        self.started = started or time.time()
        self.http: str | None = None  # the HTTP API's bound "host:port", once it listens
        self._commands: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "status": self.status,
            "pin": self.pin,
            "unpin": self.unpin,
            "force": self.force,
            "reload": self.reload,
            "config": self.config,
            "help": self.help,
        }

    def serve(self, loop: EngineLoop, reloader: Reloader) -> None:
        self.loop, self.reloader = loop, reloader

    async def __call__(self, cmd: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        command = self._commands.get(cmd)
        if self.loop is None and command is not None and cmd not in ("status", "help"):
            phase = self.startup.status()["phase"] or "between phases"
            raise AdminError("starting", f"the daemon is starting (phase: {phase}); {cmd} works once it is ready")
        if command is None:
            known = ", ".join(self._commands)
            raise AdminError("unknown_command", f"unknown command {clip(repr(cmd))}; commands: {known}")
        return await command(args)

    # ---- reading -------------------------------------------------------------------------

    async def status(self, args: dict[str, Any]) -> dict[str, Any]:
        if self.loop is None or self.reloader is None:
            starting = {**self.startup.status(), "uptime_s": round(time.time() - self.started, 3)}
            return starting | ({"http": self.http} if self.http else {})
        engine = self.loop.status  # published by the engine thread: never its live fields
        snapshot = self.reloader.snapshot
        last = self.reloader.last
        drafter = self.loop.engine.drafter  # chosen at start-up, never changed while serving
        measured = self.loop.engine.backend.measures_memory
        return {
            "state": "serving",
            "drafter": drafter.name if drafter is not None else "none",
            "k": engine.k,
            "mode": engine.mode,
            "strategy": engine.params.strategy,
            "candidate_k": list(engine.candidates),  # in force: with slots, the batch size's
            "slots": [
                {"min_batch_size": s.min_batch_size, "candidate_k": list(s.candidate_k)} for s in engine.params.slots
            ],
            # only the ema strategy keeps an EMA
            **({} if engine.ema is None else {"ema": round(engine.ema, 4)}),
            "round": engine.round,
            "switches": engine.switches,
            # the compiled CPU forward's threads (null on accelerators) and how often the count
            # served changed: fewer than every core while other processes take cores
            "threads": engine.threads,
            "thread_switches": engine.thread_switches,
            # how many sequences' rounds drafted each k (with per_sequence, the rows of a round differ)
            "sequence_rounds": {str(k): n for k, n in engine.sequence_rounds.items()},
            "generation": snapshot.generation,
            "config_sha256": snapshot.sha256,
            "last_reload": {
                "ok": last.ok,
                "trigger": last.trigger,
                "at": iso_time(last.at),
                "generation": last.generation,
                "errors": list(last.errors),
                "unchanged": last.unchanged,
            },
            "reload_failures": self.reloader.failures,
            "config_warnings": list(snapshot.warnings),
            "restart_required": list(last.restart_required),
            "runtime_states": [
                {
                    "k": s.k,
                    "build_seconds": round(s.build_seconds, 4),
                    # null where the backend does not account memory (a CPU): not measured, not 0
                    "memory_bytes": s.memory_bytes if measured else None,
                    # what a round costs at each batch size, timed before serving: what the policy
                    # prices a k it has not served lately by
                    "round_ms": {str(b): round(seconds * 1e3, 3) for b, seconds in s.round_seconds.items()},
                }
                for s in engine.states
            ],
            "tokens_per_s": round(engine.tokens_per_s, 2),
            "tokens": engine.tokens,
            "mean_accepted_drafts": round(engine.mean_accepted_drafts, 4),
            "running": engine.running,
            "in_flight": self.loop.in_flight,
            # the processes of ranks 1.. of a tensor-parallel target, which this daemon started
            "ranks": parallel.followers(),
            "http": self.http,
            "uptime_s": round(time.time() - self.started, 3),
        }

    async def config(self, args: dict[str, Any]) -> dict[str, Any]:
        overrides: dict[str, object] = {}
        pinned = self.loop.status.pinned
        if pinned is not None:
            overrides["adaptive.pinned_k"] = pinned
        values = effective(self.reloader.snapshot, overrides)
        # A restart-only key edited since the start still runs with its old value: that is the
        # value shown, and the file's waits beside it as pending.
        running = effective(self.reloader.boot)
        for path in self.reloader.pending_restart():
            values[path] = {**values[path], "value": running[path]["value"], "pending": values[path]["value"]}
        return {"generation": self.reloader.snapshot.generation, "values": values}

    async def help(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"commands": HELP}

    # ---- changing ------------------------------------------------------------------------

    async def pin(self, args: dict[str, Any]) -> dict[str, Any]:
        k = await self._built(_k_of(args))
        return await self._applied(self.loop.pin(k))

    async def unpin(self, args: dict[str, Any]) -> dict[str, Any]:
        return await self._applied(self.loop.unpin())

    async def force(self, args: dict[str, Any]) -> dict[str, Any]:
        k = _k_of(args)
        if self.loop.status.mode == "static":  # refused before a state is built for nothing
            raise AdminError("rejected", FORCE_NEEDS_ADAPTING)
        k = await self._built(k)
        return await self._applied(self.loop.force(k))

    async def _built(self, k: int) -> int:
        """k, its runtime state built between rounds first where none was (as a reload naming it
        would build it); rejected where no state can have it (above engine.max_k, or no drafter)."""
        if k not in {state.k for state in self.loop.status.states}:
            await self._applied(self.loop.build_state(k))
        return k

    async def _applied(self, done: Future[Ack]) -> dict[str, Any]:
        """Wait until the engine has applied the message at a boundary."""
        try:
            ack = await anyio.to_thread.run_sync(done.result, APPLY_TIMEOUT_S)
        except TimeoutError:
            raise AdminError("timeout", f"the engine did not reach a boundary within {APPLY_TIMEOUT_S:.0f} s") from None
        except (ValueError, KeyError) as err:
            raise AdminError("rejected", str(err).strip("'\"")) from None
        return {"k": ack.k, "mode": ack.mode, "round": ack.round}

    async def reload(self, args: dict[str, Any]) -> dict[str, Any]:
        outcome = await self.reloader.reload("admin")
        if not outcome.ok:
            raise AdminError("reload_rejected", "\n".join(outcome.errors))
        return outcome.as_dict()


def _k_of(args: dict[str, Any]) -> int:
    # "steps" is what clients before the renaming sent.
    k = args.get("k", args.get("steps"))
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise AdminError("bad_args", f'expected {{"k": K}} with an integer K >= 0, got {clip(repr(args))}')
    unknown = set(args) - {"k", "steps"}
    if unknown:
        raise AdminError("bad_args", f"unknown arguments: {', '.join(sorted(unknown))}")
    return k
