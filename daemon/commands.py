"""The admin commands behind the socket: status, pin, unpin, force, reload, config, help."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import anyio

from control.admin import AdminError, Peer
from control.config import effective
from daemon.reload import Reloader
from engine.controller import Ack
from engine.loop import EngineLoop

APPLY_TIMEOUT_S = 30.0

HELP = {
    "status": "current k, mode, strategy, EMA, round, config generation, last reload, runtime states, throughput",
    "pin": 'hold the step count: {"steps": K}; the policy keeps observing',
    "unpin": "let the policy choose again, starting from the pinned k",
    "force": 'switch to {"steps": K} at the next boundary, then adapt from there',
    "reload": "re-read the config file; replies with the new generation or every error",
    "config": "the effective configuration, each value marked default, file or admin",
    "help": "this list",
}


class AdminCommands:
    def __init__(self, loop: EngineLoop, reloader: Reloader, started: float | None = None) -> None:
        self.loop = loop
        self.controller = loop.controller
        self.reloader = reloader
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

    async def __call__(self, cmd: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        command = self._commands.get(cmd)
        if command is None:
            raise AdminError("unknown_command", f"unknown command {cmd!r}; commands: {', '.join(self._commands)}")
        return await command(args)

    # ---- reading -------------------------------------------------------------------------

    async def status(self, args: dict[str, Any]) -> dict[str, Any]:
        controller, engine, stats = self.controller, self.loop.engine, self.loop.stats
        snapshot = self.reloader.snapshot
        last = self.reloader.last
        return {
            "steps": controller.steps,
            "mode": controller.mode_name,
            "strategy": controller.params.strategy,
            "candidate_steps": list(controller.params.candidate_steps),
            "ema": round(controller.policy.ema, 4),
            "round": engine.round,
            "switches": controller.switches,
            "generation": snapshot.generation,
            "config_sha256": snapshot.sha256,
            "last_reload": {
                "ok": last.ok,
                "trigger": last.trigger,
                "at": last.at,
                "generation": last.generation,
                "errors": list(last.errors),
            },
            "reload_failures": self.reloader.failures,
            "restart_required": list(last.restart_required),
            "runtime_states": [
                {"k": s.k, "build_seconds": round(s.build_seconds, 4), "memory_bytes": s.memory_bytes}
                for s in sorted(engine.states.values(), key=lambda s: s.k)
            ],
            "tokens_per_s": round(stats.tokens_per_s, 2),
            "tokens": stats.tokens,
            "mean_accepted_drafts": round(stats.mean_accepted_drafts, 4),
            "running": len(engine.running),
            "in_flight": self.loop.in_flight,
            "http": self.http,
            "uptime_s": round(time.time() - self.started, 3),
        }

    async def config(self, args: dict[str, Any]) -> dict[str, Any]:
        overrides: dict[str, object] = {}
        if self.controller.pinned is not None:
            overrides["adaptive.steps"] = self.controller.pinned
        return {"generation": self.reloader.snapshot.generation, "values": effective(self.reloader.snapshot, overrides)}

    async def help(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"commands": HELP}

    # ---- changing ------------------------------------------------------------------------

    async def pin(self, args: dict[str, Any]) -> dict[str, Any]:
        return await self._applied(self.controller.pin(_steps(args)))

    async def unpin(self, args: dict[str, Any]) -> dict[str, Any]:
        return await self._applied(self.controller.unpin())

    async def force(self, args: dict[str, Any]) -> dict[str, Any]:
        return await self._applied(self.controller.force(_steps(args)))

    async def _applied(self, done: Future[Ack]) -> dict[str, Any]:
        """Wait until the engine has applied the message at a boundary."""
        self.loop.wake()
        try:
            ack = await anyio.to_thread.run_sync(done.result, APPLY_TIMEOUT_S)
        except TimeoutError:
            raise AdminError("timeout", f"the engine did not reach a boundary within {APPLY_TIMEOUT_S:.0f} s") from None
        except (ValueError, KeyError) as err:
            raise AdminError("rejected", str(err).strip("'\"")) from None
        return {"steps": ack.steps, "mode": ack.mode, "round": ack.round}

    async def reload(self, args: dict[str, Any]) -> dict[str, Any]:
        outcome = await self.reloader.reload("admin")
        if not outcome.ok:
            raise AdminError("reload_rejected", "\n".join(outcome.errors))
        return outcome.as_dict()


def _steps(args: dict[str, Any]) -> int:
    steps = args.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise AdminError("bad_args", f'expected {{"steps": K}} with an integer K >= 0, got {args!r}')
    unknown = set(args) - {"steps"}
    if unknown:
        raise AdminError("bad_args", f"unknown arguments: {', '.join(sorted(unknown))}")
    return steps
