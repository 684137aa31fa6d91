"""The daemon's lifecycle: start, serve, reload, stop.

One anyio task group holds everything that runs: the admin socket server, the HTTP API, the
config watcher, signal handling, and the watchdog/status reporter. The engine runs on its own
thread (a thread cannot be cancelled, so it is stopped with a message and joined). Both listeners
bind first, so that a socket or port in use stops the start before the models load; until the
models are loaded, the HTTP API answers 503 `starting`. READY=1 is sent only once every runtime state is built.
On SIGTERM the HTTP API answers new requests with 503 while in-flight ones finish, then stops
listening; a SIGTERM while the models load stops the start there, listeners closed.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from control.admin import AdminSocketError, serve_admin
from control.assemble import Phase, build_engine
from control.snapshot import ConfigSnapshot
from daemon.auth import api_key
from daemon.commands import AdminCommands
from daemon.http import Front, HttpBindError, HttpServer, OpenAIApi
from daemon.metrics import Metrics
from daemon.notify import Notifier
from daemon.reload import Reloader
from daemon.startup import Startup
from daemon.watch import watch_config
from engine import parallel
from engine.chat_template import ChatTemplate, ChatTemplateError
from engine.loop import EngineLoop
from engine.model.config import CheckpointError

log = structlog.get_logger("adaspec.daemon")

START_TIMEOUT_EXTENSION_S = 120.0
STATUS_INTERVAL_S = 2.0
# How often the event loop looks whether the engine thread has loaded the models: no thread of
# its own waits, so that a stop signal meanwhile can end the process at once.
STARTING_POLL_S = 0.05
PR_SET_NAME = 15  # prctl(2): set the calling thread's name
# Past the drain deadline, how long the requests the engine ended have to tell their clients so.
CUT_OFF_GRACE_S = 2.0


class Daemon:
    def __init__(self, config_path: Path, snapshot: ConfigSnapshot) -> None:
        self.config_path = config_path
        self.snapshot = snapshot
        self.notifier = Notifier()
        self.started = time.time()
        self.stopping = anyio.Event()
        self.loop: EngineLoop | None = None
        self.thread: threading.Thread | None = None
        self.reloader: Reloader | None = None  # once the engine is built: what SIGHUP reloads through
        self.starting: anyio.CancelScope | None = None  # the wait for the engine, cancelled by a stop signal
        self.reload_owed = False  # a SIGHUP came while starting: reload once serving
        self.rank_lost = False  # a rank of a tensor-parallel target exited: the exit status says so

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; the exit status of the process."""
        self.notifier.extend_timeout(START_TIMEOUT_EXTENSION_S)
        self.notifier.status("loading models and building runtime states")
        log.info("starting", config=str(self.config_path), generation=self.snapshot.generation, pid=os.getpid())
        try:
            key = api_key(self.snapshot.server)
        except ValueError as err:  # the key file went away since the config was read
            log.error("cannot read the API key", error=str(err))
            return 1
        target = self.snapshot.engine.target
        try:  # before the models load: a template that cannot compile is the checkpoint's to fix
            template = ChatTemplate.from_checkpoint(target)
        except ChatTemplateError as err:
            log.error("cannot start", error=f"{target}: {err}")
            return 1
        except CheckpointError as err:  # a GGUF file changed since the config check: it names the file
            log.error("cannot start", error=str(err))
            return 1
        metrics = Metrics(self.snapshot.engine.max_k)
        startup = Startup(self.notifier)
        commands = AdminCommands(startup, self.started)
        admin = self.snapshot.admin
        self.starting = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            # Signals first: a stop from here on closes whatever is bound and removes the socket.
            await tg.start(self._handle_signals)
            # The admin socket answers from the start: `adaspecctl status` names the phase.
            try:
                await tg.start(
                    partial(
                        serve_admin,
                        admin.socket,
                        commands,
                        mode=admin.mode_bits,
                        group=admin.group,
                        idle_timeout=admin.idle_timeout_s,
                        max_connections=admin.max_connections,
                    )
                )
            except AdminSocketError as err:  # in use by another daemon, a path too long, ...
                log.error("cannot start", error=str(err))
                tg.cancel_scope.cancel()
                return 1
            server = self.snapshot.server
            # Its 503s while starting are counted and name the phase `adaspecctl status` names.
            front = Front(metrics, phase=lambda: startup.status()["phase"])
            http = HttpServer(front, server.host, server.port)
            try:
                commands.http = await tg.start(http.serve)
            except HttpBindError as err:  # the port is taken, the address is not this host's, ...
                log.error("cannot start", error=str(err))
                tg.cancel_scope.cancel()
                return 1
            built: Future[EngineLoop] = Future()
            build = partial(build_engine, on_step=metrics.observe_step, on_switch=metrics.observe_switch)
            work = (built, build, self.snapshot, startup.phase)
            self.thread = threading.Thread(target=_engine_thread, args=work, name="adaspec-engine", daemon=True)
            self.thread.start()
            try:
                with self.starting:  # cancelled on entry where a stop signal came while binding
                    # Given up on a stop signal: a load cannot be interrupted, and exiting ends it.
                    while not built.done():
                        await anyio.sleep(STARTING_POLL_S)
                    self.loop = built.result()
            except Exception:  # logged with its phase; the listeners go with the task group
                self.loop = None
            if self.loop is None:
                await http.close()  # a probe answered 503 meanwhile gets its response whole
                tg.cancel_scope.cancel()
                if not self.starting.cancel_called:
                    return 1
            else:
                await self._serve(self.loop, startup, commands, metrics, front, tg, key, template)
                await http.close()
                tg.cancel_scope.cancel()
        if self.loop is None:  # stopped while the models loaded
            log.info("stopped", before_ready=True)
            # The engine thread is still loading: the interpreter's shutdown would meet it inside
            # torch, which then aborts the process; so the process ends here, its logs written.
            logging.shutdown()
            sys.stderr.flush()
            os._exit(0)
        return await self._stop_engine()

    async def _serve(
        self,
        loop: EngineLoop,
        startup: Startup,
        commands: AdminCommands,
        metrics: Metrics,
        front: Front,
        tg: TaskGroup,
        key: str | None,
        template: ChatTemplate,
    ) -> None:
        """The engine is built: hand the port the API, reload what changed while it loaded, watch
        the config, tell systemd READY=1; then serve until a stop signal, and drain."""
        native = loop.engine.target.model.native  # the bytes the target's weights hold, where the kernels serve it
        weights = {"target_weight_bytes": native.weight_bytes} if native is not None else {}
        log.info("started", seconds=round(time.monotonic() - startup.started, 3), **weights)
        reloader = self.reloader = Reloader(self.config_path, self.snapshot, loop, self.notifier)
        metrics.watch(loop, reloader)
        api = self._api(loop, metrics, key, template)
        front.attach(api.app)
        commands.serve(loop, reloader)
        tg.start_soon(self._watch_config, reloader)
        tg.start_soon(self._report, reloader)
        self.notifier.ready()
        api.ready = True
        log.info("ready", admin_socket=str(self.snapshot.admin.socket), http=commands.http, k=loop.status.k)
        await self._catch_up(reloader)
        await self.stopping.wait()
        await self._drain()

    async def _catch_up(self, reloader: Reloader) -> None:
        """Reload what the watcher, started only now, could not see: an edit made while the models
        loaded, or a SIGHUP then."""
        try:
            edited = hashlib.sha256(self.config_path.read_bytes()).hexdigest() != self.snapshot.sha256
        except OSError:  # gone meanwhile: the reload says so, and status shows it
            edited = True
        if edited or self.reload_owed:
            await reloader.reload("sighup" if self.reload_owed else "watch")

    def _api(self, loop: EngineLoop, metrics: Metrics, key: str | None, template: ChatTemplate) -> OpenAIApi:
        target, server = self.snapshot.engine.target, self.snapshot.server
        log.info("http api key", required=key is not None, metrics_need_key=server.metrics_need_key and key is not None)
        return OpenAIApi(
            loop,
            metrics,
            model=server.model_name or (target.stem if target.is_file() else target.name),
            max_queue=server.max_queue,
            chat_template=template,
            api_key=key,
            metrics_need_key=server.metrics_need_key,
        )

    async def _handle_signals(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """From the start: SIGHUP reloads (one while starting waits for the engine); SIGTERM and
        SIGINT stop, while starting by abandoning the load."""
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    if self.reloader is None:
                        log.info("reload deferred: the daemon is still starting", signal=name)
                        self.reload_owed = True
                    else:
                        await self.reloader.reload("sighup")
                    continue
                if self.stopping.is_set():
                    log.warning("second stop signal: exiting at once", signal=name)
                    os._exit(1)
                log.info("stopping", signal=name, before_ready=self.loop is None)
                self.notifier.stopping()
                self.stopping.set()
                if self.loop is None and self.starting is not None:
                    self.starting.cancel()

    async def _drain(self) -> None:
        """Admit nothing new; let in-flight requests finish, up to the configured deadline. Past
        it, the engine ends those left, and each client is told so before the server closes."""
        assert self.loop is not None
        self.loop.drain()
        deadline = self.snapshot.shutdown.drain_timeout_s
        if await self._in_flight_done(deadline):
            log.info("drained")
            return
        log.warning("drain deadline passed", in_flight=self.loop.in_flight, deadline_s=deadline, action="ending them")
        self.loop.cancel_all()
        if not await self._in_flight_done(CUT_OFF_GRACE_S):
            log.warning("requests still in flight after they were ended", in_flight=self.loop.in_flight)

    async def _in_flight_done(self, seconds: float) -> bool:
        """Whether every request in flight has finished within `seconds`."""
        assert self.loop is not None
        with anyio.move_on_after(seconds, shield=True):
            while self.loop.in_flight:
                await anyio.sleep(0.02)
        return not self.loop.in_flight

    async def _stop_engine(self) -> int:
        assert self.loop is not None and self.thread is not None
        self.loop.stop()
        await anyio.to_thread.run_sync(self.thread.join, 10.0)
        if self.snapshot.engine.tensor_parallel > 1:  # the other ranks stop with this one
            await anyio.to_thread.run_sync(parallel.shutdown, parallel.Leader.of(self.loop.engine.model))
        if self.loop.error is not None or self.rank_lost:
            return 1
        log.info("stopped")
        return 0

    async def _watch_config(self, reloader: Reloader) -> None:
        # A deleted file is a reload too: it is rejected (the running config stays) and
        # `adaspecctl status` says so until the file is back.
        await watch_config(self.config_path, partial(reloader.reload, "watch"))

    async def _report(self, reloader: Reloader) -> None:
        """STATUS= for systemctl status, and WATCHDOG=1 while the engine thread is alive."""
        assert self.loop is not None
        watchdog = self.notifier.watchdog_interval()
        interval = min(STATUS_INTERVAL_S, watchdog) if watchdog else STATUS_INTERVAL_S
        while True:
            loop = self.loop
            self.notifier.status(
                f"k={loop.status.k} mode={loop.status.mode} "
                f"tokens/s={loop.status.tokens_per_s:.1f} generation={reloader.snapshot.generation}"
            )
            if watchdog:
                age = time.monotonic() - loop.heartbeat
                if self.thread is not None and self.thread.is_alive() and age < 2 * watchdog:
                    self.notifier.watchdog()
                else:
                    log.error("engine thread is not making progress: no watchdog ping", heartbeat_age_s=age)
            if self.thread is not None and not self.thread.is_alive():
                log.error("engine thread died; stopping", error=repr(loop.error))
                self.stopping.set()
                return
            lost = parallel.lost()
            if lost is not None:  # idle or not, a group without one of its ranks cannot serve
                log.error("a rank of the tensor-parallel group is gone; stopping", lost=lost)
                self.rank_lost = True
                self.stopping.set()
                return
            await anyio.sleep(interval)


def _engine_thread(
    built: Future[EngineLoop],
    build: Callable[[ConfigSnapshot, Phase], EngineLoop],
    snapshot: ConfigSnapshot,
    phase: Phase,
) -> None:
    """Build the engine, then run it, on this one thread. Each thread that runs the compiled
    kernels gets its own OpenMP team; with a second team libgomp manages more threads than there
    are cores and stops spinning at its barriers, and a forward takes about three times as long.
    So nothing else in the daemon runs them."""
    _name_os_thread(b"adaspec-engine")
    try:
        loop = build(snapshot, phase)
    except BaseException as err:
        built.set_exception(err)
        return
    # Start-up made millions of objects (torch, the models) that live as long as the process; the
    # collector would walk them again and again, a few percent of every round's time.
    gc.freeze()
    built.set_result(loop)
    loop.run()


def _name_os_thread(name: bytes) -> None:
    """The calling thread's name as `top -H` and `ps -L` show it (Linux; the threads it starts,
    the kernels' OpenMP workers among them, inherit it). Python 3.11 names only its own objects."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # a name is a convenience: never a reason not to serve
