"""The HTTP API: OpenAI-compatible completions and chat completions, models, health and metrics.

Routes run on the daemon's event loop; generation runs on the engine thread. A request's tokens
come back through a `Submission`, which the engine thread feeds with `call_soon_threadsafe` (the
engine never waits for the event loop) and which cancels the request in the engine when the
handler leaves before the end: a client that disconnects frees its batch slot at the next
boundary, streaming or not.

Admission: at most engine.max_batch_size + server.max_queue requests are in flight (running or
queued in the engine); beyond that, and while the daemon drains, new requests get 503 with
Retry-After, in OpenAI's error format like every other error here. The port listens from the
start (`Front`): while the models load, every request gets 503 `starting` the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import h11
import structlog
import uvicorn
from anyio.abc import TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from daemon.auth import ApiKeyMiddleware
from daemon.metrics import CLIENT_CLOSED, Metrics, MetricsMiddleware
from daemon.protocol import ApiError, GenerateRequest, Reply, Usage, parse_chat, parse_completion
from daemon.text import TextStream
from engine.chat_template import ChatTemplate, ChatTemplateError
from engine.core import SequenceOutput
from engine.loop import EngineLoop
from engine.request import Request

log = structlog.get_logger("adaspec.http")

MAX_BODY_BYTES = 4 * 1024 * 1024
RETRY_AFTER_S = 1
# A connection's request headers must all arrive within this of its opening or its last byte.
HEADERS_TIMEOUT_S = 10.0
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Submission:
    """One request in the engine, seen from the event loop: its outputs in order, and a tally."""

    def __init__(self, loop: EngineLoop, request: Request, started: float) -> None:
        self.loop = loop
        self.request = request
        self.started = started  # time.perf_counter() when the HTTP request arrived
        self.finished = False  # the engine has sent the last output
        self.closed = False
        self.first_token_s: float | None = None
        self.tokens = 0
        self.rounds = 0
        self.accepted = 0
        self.proposed = 0
        self._outputs: asyncio.Queue[SequenceOutput] = asyncio.Queue()
        self._event_loop = asyncio.get_running_loop()

    @classmethod
    def start(cls, loop: EngineLoop, request: Request, started: float) -> Submission:
        """Submit `request`; ValueError if the engine refuses it, RuntimeError while draining."""
        submission = cls(loop, request, started)
        loop.submit(request, submission._on_output)
        return submission

    def _on_output(self, out: SequenceOutput) -> None:  # the engine thread
        try:
            self._event_loop.call_soon_threadsafe(self._outputs.put_nowait, out)
        except RuntimeError:
            pass  # the event loop is closed: the daemon is exiting and nobody is listening

    def __aiter__(self) -> Submission:
        return self

    async def __anext__(self) -> SequenceOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._outputs.get()
        self.finished = out.finish_reason is not None
        if out.new_tokens and self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.started
        self.tokens += len(out.new_tokens)
        if out.verified:
            self.rounds += 1
            self.accepted += out.drafts_accepted
            self.proposed += out.drafts_proposed
        return out

    def close(self) -> None:
        """Cancel the request in the engine unless it has finished (the client left early)."""
        self.closed = True
        if not self.finished:
            self.finished = True
            self.loop.cancel(self.request.id)

    def stats(self) -> dict[str, int]:
        """The non-standard "adaspec" field: this request's speculation, and the k in force now."""
        return {
            "rounds": self.rounds,
            "accepted_drafts": self.accepted,
            "proposed_drafts": self.proposed,
            "k": self.loop.status.k,
        }


class Front:
    """What the HTTP port serves: while the models load, 503 to every request (`starting`; /health
    as {"status": "starting", "phase": ...}), then the API once `attach` hands it over. Listening
    from the start lets probes tell a daemon that is loading from one that is gone, and a taken port
    stop the start before the models load.

    `phase`: the start-up phase in progress, as `adaspecctl status` names it (None between two);
    `metrics`: where those 503s are counted, as the API counts its answers."""

    def __init__(self, metrics: Metrics | None = None, phase: Callable[[], str | None] | None = None) -> None:
        self.app: ASGIApp | None = None
        self.phase = phase
        self._starting: ASGIApp = self._answer_starting
        if metrics is not None:
            self._starting = MetricsMiddleware(self._answer_starting, metrics=metrics, endpoints=ENDPOINTS)

    def attach(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await (self.app if self.app is not None else self._starting)(scope, receive, send)

    async def _answer_starting(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        message = "the server is starting: its models are loading"
        health: dict[str, Any] = {"status": "starting"}
        if self.phase is not None:
            phase = self.phase()
            message += f" (phase: {phase or 'between phases'})"
            health["phase"] = phase
        err = _unavailable(f"{message}; retry later", "starting")
        body = health if scope["path"] == "/health" else err.body()
        await JSONResponse(body, status_code=err.status, headers=err.headers)(scope, receive, send)


class OpenAIApi:
    """The routes. `ready` is set by the daemon once it has told systemd READY=1."""

    def __init__(
        self,
        loop: EngineLoop,
        metrics: Metrics,
        *,
        model: str,
        max_queue: int,
        chat_template: ChatTemplate,
        api_key: str | None = None,
        metrics_need_key: bool = False,
    ) -> None:
        self.loop = loop
        self.metrics = metrics
        self.model = model
        self.capacity = loop.engine.max_batch_size + max_queue
        self.chat_template = chat_template
        self.tokenizer = loop.engine.target.tokenizer
        self.max_seq_len = loop.engine.max_seq_len
        # The most characters one token stands for: a text of n characters holds at least n / this.
        self.longest_token = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
        self.created = int(time.time())
        self.ready = False
        self.app: ASGIApp = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model_info, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_text, methods=["GET"]),
            ],
            middleware=[Middleware(MetricsMiddleware, metrics=metrics, endpoints=ENDPOINTS)]
            + ([Middleware(ApiKeyMiddleware, key=api_key, protect_metrics=metrics_need_key)] if api_key else []),
            exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error},
        )

    # ---- generation ----------------------------------------------------------------------

    async def completions(self, http: HttpRequest) -> Response:
        started = time.perf_counter()
        return await self._generate(http, parse_completion(await _read_json(http)), started)

    async def chat_completions(self, http: HttpRequest) -> Response:
        started = time.perf_counter()
        return await self._generate(http, parse_chat(await _read_json(http)), started)

    async def _generate(self, http: HttpRequest, req: GenerateRequest, started: float) -> Response:
        if req.model is not None and req.model != self.model:
            message = f"The model '{req.model}' does not exist; this server serves '{self.model}'"
            raise ApiError(404, message, param="model", code="model_not_found")
        prompt = self._prompt_ids(req)
        prompt_param = "messages" if req.chat else "prompt"
        if len(prompt) >= self.max_seq_len:  # the prompt alone fills the context, whatever max_tokens says
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_seq_len} tokens; the {prompt_param} alone "
                f"{'take' if req.chat else 'takes'} {len(prompt)}, leaving none to generate. "
                f"Shorten the {prompt_param}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else self.max_seq_len - len(prompt)
        if len(prompt) + max_tokens > self.max_seq_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_seq_len} tokens; this request needs "
                f"{len(prompt) + max_tokens} ({len(prompt)} in the prompt, max_tokens {max_tokens}). "
                "Shorten the prompt or lower max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        self._admit()
        reply = Reply(req.chat, self.model)
        request = Request(tuple(prompt), req.sampling(max_tokens), reply.id)
        try:
            submission = Submission.start(self.loop, request, started)
        except ValueError as err:  # the engine's own checks of the prompt (empty, ids outside the vocabulary)
            raise ApiError(400, str(err), param=prompt_param, code="invalid_prompt") from None
        except RuntimeError:  # began draining since _admit
            raise _unavailable("the server is shutting down", "draining") from None
        text = TextStream(self.tokenizer, req.stop)
        if req.stream:
            events = self._stream(submission, reply, text, req.include_usage, len(prompt))
            # The background task also closes a stream the client left before it even began.
            close = BackgroundTask(self._close, submission)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS, background=close)
        return await self._complete(http, submission, reply, text, len(prompt))

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.chat:
            try:
                rendered = self.chat_template.render(req.messages)
            except ChatTemplateError as err:
                raise ApiError(400, str(err), param="messages") from None
            return self._encode(rendered, "messages", add_special_tokens=not self.chat_template.adds_special_tokens)
        if isinstance(req.prompt, str):
            return self._encode(req.prompt, "prompt")
        return list(req.prompt or ())

    def _encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; a text too long for the context whatever its tokens is refused before
        the tokenizer reads it: megabytes take it seconds on the event loop, every client waiting."""
        fewest = len(text) // self.longest_token
        if fewest > self.max_seq_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_seq_len} tokens; a prompt of {len(text)} "
                f"characters holds at least {fewest}. Shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def _admit(self) -> None:
        if self.loop.draining:
            raise _unavailable("the server is shutting down", "draining")
        in_flight = self.loop.in_flight
        if in_flight >= self.capacity:
            raise _unavailable(f"the server is at capacity ({in_flight} requests in flight); retry later", "overloaded")

    async def _complete(
        self, http: HttpRequest, submission: Submission, reply: Reply, text: TextStream, prompt_tokens: int
    ) -> Response:
        finish_reason = None
        async with anyio.create_task_group() as tg:
            # Nothing is sent until the end, so only listening tells that the client has gone.
            tg.start_soon(_cancel_on_disconnect, http, tg.cancel_scope)
            try:
                async for out in submission:
                    finish_reason = out.finish_reason
                    text.push(out.new_tokens, final=finish_reason is not None)
            finally:
                self._close(submission)
            tg.cancel_scope.cancel()
        if finish_reason is None:
            return Response(status_code=CLIENT_CLOSED)
        if finish_reason == "cancelled":  # not by the client, who would be gone: the daemon is stopping
            raise _shut_down()
        usage = Usage(prompt_tokens, submission.tokens)
        return JSONResponse(reply.response(text.text, finish_reason, usage, submission.stats()))

    async def _stream(
        self, submission: Submission, reply: Reply, text: TextStream, include_usage: bool, prompt_tokens: int
    ) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects: `finally` cancels the request.
        try:
            if reply.chat:
                yield _sse(reply.chunk(first=True, usage=include_usage))
            finish_reason = None
            async for out in submission:
                finish_reason = out.finish_reason
                piece = text.push(out.new_tokens, final=finish_reason is not None)
                if piece:
                    yield _sse(reply.chunk(piece, usage=include_usage))
            if finish_reason == "cancelled":  # not by the client, who would be gone: the daemon is stopping
                yield _sse(_shut_down().body())
                yield "data: [DONE]\n\n"
                return
            last = reply.chunk(finish_reason=finish_reason, usage=include_usage)
            if include_usage:
                yield _sse(last)
                last = reply.usage_chunk(Usage(prompt_tokens, submission.tokens))
            yield _sse(last | {"adaspec": submission.stats()})
            yield "data: [DONE]\n\n"
        finally:
            self._close(submission)

    def _close(self, submission: Submission) -> None:
        if submission.closed:
            return
        submission.close()
        if submission.first_token_s is not None:
            self.metrics.first_token.observe(submission.first_token_s)

    # ---- the rest ------------------------------------------------------------------------

    async def models(self, http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_info(self, http: HttpRequest) -> Response:
        if not http.path_params["model"]:  # /v1/models/ is the list, as with the trailing slash left off
            return await self.models(http)
        if http.path_params["model"] != self.model:
            raise ApiError(404, f"The model '{http.path_params['model']}' does not exist", code="model_not_found")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "adaspec"}

    async def health(self, http: HttpRequest) -> Response:
        if self.loop.error is not None:
            status = "engine_failed"
        elif self.loop.draining:
            status = "draining"
        elif not self.ready:
            status = "starting"
        else:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": status}, status_code=503)

    async def metrics_text(self, http: HttpRequest) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def _read_json(http: HttpRequest) -> Any:
    body = bytearray()
    async for chunk in http.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
    try:
        parsed = json.loads(body)
    except ValueError as err:  # UnicodeDecodeError is one too
        raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if b"\\ud" in body or b"\\uD" in body:  # an escaped surrogate: a pair is one character, a lone one is no text
        try:
            json.dumps(parsed, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as err:
            lone = ascii(err.object[err.start : err.end])
            raise ApiError(
                400, f"the request body holds a lone surrogate {lone}, not text", code="invalid_json"
            ) from None
    return parsed


async def _cancel_on_disconnect(http: HttpRequest, scope: anyio.CancelScope) -> None:
    # The body has been read: the next message is the disconnect (uvicorn sends it then).
    while (await http.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, type="server_error", code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def _shut_down() -> ApiError:
    """What a client whose request the daemon ended at its drain deadline is told."""
    return _unavailable("the server shut down before this request finished; retry it", "shutdown")


async def _api_error(http: HttpRequest, err: Exception) -> Response:
    assert isinstance(err, ApiError)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _http_error(http: HttpRequest, err: Exception) -> Response:
    assert isinstance(err, HTTPException)
    code = "not_found" if err.status_code == 404 else None
    message = f"{http.method} {http.url.path}: {err.detail}"
    # A 405's Allow header says which methods the path takes.
    return await _api_error(http, ApiError(err.status_code, message, code=code, headers=err.headers))


async def _server_error(http: HttpRequest, err: Exception) -> Response:
    log.error("request failed", path=http.url.path, error=repr(err))
    return await _api_error(http, ApiError(500, "internal server error", type="server_error"))


# ---- the server -------------------------------------------------------------------------------


class HttpBindError(OSError):
    """The configured address cannot be listened on."""


class HttpServer:
    """uvicorn serving an app on a socket bound here, so that the daemon sends READY=1 only once
    the API is listening, and so that port 0 works: the bound address is logged and returned."""

    def __init__(self, app: ASGIApp, host: str, port: int, shutdown_timeout_s: float = 5.0) -> None:
        self.host = host
        self.port = port
        self.shutdown_timeout_s = shutdown_timeout_s
        config = uvicorn.Config(
            app,
            http=_HeadersInTime,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=shutdown_timeout_s,
        )
        self._server = _Server(config)
        self._stopped = anyio.Event()

    async def serve(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until `close`; start with `address = await tg.start(server.serve)`."""
        sock = _bind(self.host, self.port)
        try:
            address = _format_address(sock.getsockname())
            log.info("http listening", address=address)
            task_status.started(address)
            await self._server.serve(sockets=[sock])
        finally:
            sock.close()
            self._stopped.set()

    async def close(self) -> None:
        """Stop listening, let responses under way end, close idle keep-alive connections."""
        self._server.should_exit = True
        with anyio.move_on_after(self.shutdown_timeout_s + 1.0):
            await self._stopped.wait()


class _HeadersInTime(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request headers are not all in
    HEADERS_TIMEOUT_S after it opened or sent its last byte: uvicorn waits for them forever, and a
    thousand clients that send half a request and nothing more held every file descriptor."""

    _late: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._late is not None:
            self._late.cancel()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        # Between requests (h11's IDLE) with no response under way: an idle keep-alive connection
        # is closed by uvicorn's own keep-alive timeout first.
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _watch_headers(self) -> None:
        if self._late is not None:
            self._late.cancel()
        self._late = (
            self.loop.call_later(HEADERS_TIMEOUT_S, self._headers_late) if self._waiting_for_headers() else None
        )

    def _headers_late(self) -> None:
        self._late = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The daemon owns SIGTERM and SIGINT (it drains first); uvicorn must not take them over.
        yield


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, its connections with Nagle's algorithm off. A response goes out as
    two writes (headers, then body; or one per streamed chunk); with Nagle on, a write after the
    first of a keep-alive connection waits for the client's delayed ACK, 40 ms. asyncio turns it
    off only on sockets that say they are TCP, and `create_server` leaves proto at 0."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        bound = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as err:
        raise HttpBindError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock = socket.socket(bound.family, bound.type, socket.IPPROTO_TCP, fileno=bound.detach())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # connections inherit it on Linux too
    sock.setblocking(False)
    return sock


def _format_address(name: tuple[Any, ...]) -> str:
    host, port = name[0], name[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
