"""Replicas behind an existing router: two daemons (real processes) behind sglang-router, SGLang's
gateway (a PyPI package with its own dependencies, so .ci/run installs it beside the project's
environment and names it in ADASPEC_ROUTER; without it these tests skip)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.fleet import start_router
from tests.conftest import ROOT
from tests.test_daemon import Daemon, start_daemon, stop_daemon

ROUTER = os.environ.get("ADASPEC_ROUTER") or shutil.which("sglang-router")
pytestmark = pytest.mark.skipif(ROUTER is None, reason="sglang-router is not installed (ADASPEC_ROUTER names it)")

PROMPTS = ["def add(a, b):", "import os\n\n\ndef main(", "class Stack:\n    def push(self, item):"]


def complete(url: str, prompt: str, timeout: float = 60.0) -> httpx.Response:
    # The router checks the body as OpenAI's schema has it: "model" is required there.
    body = {"model": "target", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[list[Daemon], str, Path]]:
    folders = [Path(tempfile.mkdtemp(prefix="adaspecd-", dir="/tmp")) for _ in range(2)]
    daemons = [start_daemon(folder) for folder in folders]
    assert [m["id"] for m in httpx.get(f"{daemons[0].url}/v1/models").json()["data"]] == ["target"]
    assert ROUTER is not None
    # Once it serves: it takes its workers in as each answers its health check.
    router, url, _ = start_router(ROUTER, [d.url for d in daemons], folders[0])
    log = folders[0] / "router.log"
    try:
        yield daemons, url, log
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(15)
        except subprocess.TimeoutExpired:
            router.kill()
        for daemon in daemons:
            stop_daemon(daemon)


def test_replicas_behind_the_router_reply_as_one_daemon_and_share_the_load(fleet):
    daemons, url, _ = fleet
    expected = {p: complete(daemons[0].url, p).json()["choices"][0]["text"] for p in PROMPTS}
    before = [d.status()["tokens"] for d in daemons]
    for prompt in PROMPTS * 2:
        response = complete(url, prompt)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[prompt]  # greedy: as one daemon replies
    served = [d.status()["tokens"] - b for d, b in zip(daemons, before)]
    assert all(n > 0 for n in served), served  # round robin: both replicas served


def test_a_replica_killed_mid_load_costs_no_request(fleet):
    """Eight clients in flight through the router; a third of the way through, one replica is
    killed (SIGKILL): what it held in flight is retried on the other, and every reply is a
    daemon's greedy text."""
    daemons, url, log = fleet
    expected = {p: complete(daemons[0].url, p).json()["choices"][0]["text"] for p in PROMPTS}
    done, lock = [], threading.Lock()

    def client(i: int) -> tuple[int, str]:
        prompt = PROMPTS[i % len(PROMPTS)]
        response = complete(url, prompt)
        with lock:
            done.append(i)
            if len(done) == 16:
                daemons[1].process.kill()
        ok = response.status_code == 200
        return response.status_code, response.json()["choices"][0]["text"] if ok else response.text

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(client, range(48)))
    assert daemons[1].process.wait(10) == -signal.SIGKILL
    failed = [(i, reply) for i, (status, reply) in enumerate(replies) if status != 200]
    assert not failed, f"{failed[:3]}\n{log.read_text()[-2000:]}"
    assert all(text == expected[PROMPTS[i % len(PROMPTS)]] for i, (_, text) in enumerate(replies))


def test_the_fleet_bench_steers_replicas_through_load_and_a_kill(tmp_path):
    """python -m bench.fleet, small: two replicas behind the router serve clients while every
    config is edited, adaspecctl pins and unpins the fleet and one replica is killed and started
    again; no greedy reply differs from target-only output, nothing fails beyond what the killed
    replica held, and both end on the edited config."""
    out = tmp_path / "fleet.json"
    command = [sys.executable, "-m", "bench.fleet", "--replicas", "2", "--clients", "4", "--seconds", "12"]
    done = subprocess.run(
        [*command, "--router", str(ROUTER), "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["fleet"]["completed"] > 0 and report["fleet"]["mismatched"] == 0
    assert report["one_daemon"]["completed"] > 0 and report["one_daemon"]["failed"] == {}
    assert [r["strategy"] for r in report["replicas_at_end"]] == ["ema", "ema"]
    assert report["replicas_at_end"][0]["generation"] == 2  # edited live; the other was started again
    assert any("killed" in line for line in report["steering"]) and report["steering_problems"] == []
    assert "adaspecctl pin 3 on 2 sockets: exit 0" in report["steering"]
