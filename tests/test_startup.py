"""While the daemon starts, the admin socket answers (`status` names the phase in progress) and the
HTTP port answers 503 `starting`."""

from __future__ import annotations

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from control.admin import AdminError, Peer
from daemon.commands import AdminCommands
from daemon.http import Front, HttpServer
from daemon.metrics import Metrics
from daemon.notify import Notifier
from daemon.startup import Startup

PEER = Peer(pid=1, uid=0, gid=0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_status_names_the_phase_and_other_commands_wait_for_ready() -> None:
    startup = Startup(Notifier(""))
    commands = AdminCommands(startup)
    with startup.phase("load target /models/target"):
        status = await commands("status", {}, PEER)
        assert status["state"] == "starting" and status["phase"] == "load target /models/target"
        with pytest.raises(AdminError) as caught:
            await commands("pin", {"steps": 3}, PEER)
        assert caught.value.code == "starting" and "load target" in caught.value.message
        assert "pin" in (await commands("help", {}, PEER))["commands"]
        assert "http" not in status  # not bound yet
        commands.http = "127.0.0.1:8000"
        assert (await commands("status", {}, PEER))["http"] == "127.0.0.1:8000"  # where to probe meanwhile
    status = await commands("status", {}, PEER)
    assert status["phase"] is None and [p["phase"] for p in status["phases_done"]] == ["load target /models/target"]
    with pytest.raises(RuntimeError), startup.phase("build runtime state k=3"):
        raise RuntimeError("out of memory")
    assert [p["phase"] for p in (await commands("status", {}, PEER))["phases_done"]] == ["load target /models/target"]


@pytest.mark.anyio
async def test_the_http_port_answers_starting_until_the_api_is_attached() -> None:
    """The port listens from the start: every route answers 503 `starting` (with Retry-After, in
    OpenAI's error format; /health as its status) until the API is handed over, then the API does."""
    front = Front()
    server = HttpServer(front, "127.0.0.1", 0)
    async with anyio.create_task_group() as tg:
        address = await tg.start(server.serve)
        async with httpx.AsyncClient(base_url=f"http://{address}") as client:
            health = await client.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "starting"}
            generate = await client.post("/v1/completions", json={"prompt": "def", "max_tokens": 4})
            assert generate.status_code == 503 and generate.headers["retry-after"] == "1"
            error = generate.json()["error"]
            assert error["code"] == "starting" and "loading" in error["message"]
            assert (await client.get("/metrics")).status_code == 503

            async def ok(request: Request) -> Response:
                return PlainTextResponse("served")

            front.attach(Starlette(routes=[Route("/health", ok)]))
            served = await client.get("/health")
            assert served.status_code == 200 and served.text == "served"
        await server.close()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_starting_answers_name_the_phase_and_are_counted_once_the_api_serves_metrics() -> None:
    """Issue 64: /health while starting names the phase `adaspecctl status` names (null between two),
    the other routes' 503s say it too, and every one of them is counted in
    adaspec_http_requests_total with the labels the API gives its own answers."""
    startup = Startup(Notifier(""))
    metrics = Metrics(max_k=3)
    front = Front(metrics, phase=lambda: startup.status()["phase"])
    server = HttpServer(front, "127.0.0.1", 0)
    async with anyio.create_task_group() as tg:
        address = await tg.start(server.serve)
        async with httpx.AsyncClient(base_url=f"http://{address}") as client:
            health = await client.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "starting", "phase": None}
            with startup.phase("load target models/target"):
                health = await client.get("/health")
                assert health.status_code == 503 and health.headers["retry-after"] == "1"
                assert health.json() == {"status": "starting", "phase": "load target models/target"}
                generate = await client.post("/v1/chat/completions", json={"messages": []})
                error = generate.json()["error"]
                assert generate.status_code == 503 and error["code"] == "starting"
                assert "(phase: load target models/target)" in error["message"]
                assert (await client.get("/nowhere")).status_code == 503

            async def exposition(request: Request) -> Response:  # what the API's /metrics serves
                return Response(metrics.exposition())

            front.attach(Starlette(routes=[Route("/metrics", exposition)]))
            text = (await client.get("/metrics")).text
        await server.close()
        tg.cancel_scope.cancel()
    counted = {
        (sample.labels["endpoint"], sample.labels["status"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "adaspec_http_requests_total"
    }
    # The attached app counts nothing of its own here: only the starting answers are in it.
    assert counted == {("/health", "503"): 2, ("/v1/chat/completions", "503"): 1, ("other", "503"): 1}
