"""A real daemon while its models load: what its HTTP port answers then, and what it counts."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import DEFAULT_DRAFT, DEFAULT_TARGET, ROOT
from tests.test_daemon import CONFIG, START_TIMEOUT_S, Daemon, stop_daemon


def test_health_while_the_models_load_names_the_phase_and_is_counted_once_serving():
    """Issue 64: a probe of /health during start-up gets 503 `starting` naming the phase in
    progress (one of those the log then lists), and /metrics, once it serves, counts those 503s."""
    folder = Path(tempfile.mkdtemp(prefix="adaspecd-", dir="/tmp"))
    config = folder / "config.toml"
    log = folder / "daemon.log"
    sock = folder / "admin.sock"
    # Timing rounds up to batch 16 keeps it loading for seconds after the port is bound.
    sections = {"server": "", "engine": "", "shutdown": "", "max_batch_size": 16}
    config.write_text(CONFIG.format(target=DEFAULT_TARGET, draft=DEFAULT_DRAFT, socket=sock, **sections))
    command = [sys.executable, "-m", "daemon.cli", "--config", str(config)]
    with log.open("w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    daemon = Daemon(process, folder, config, sock, log, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM), [])
    try:
        address = daemon.wait_for(
            lambda: next((e["address"] for e in daemon.events("http listening")), None), START_TIMEOUT_S, "the port"
        )
        starting: list[dict] = []
        while not daemon.events("ready"):
            assert process.poll() is None, log.read_text()[-2000:]
            health = httpx.get(f"http://{address}/health", timeout=10)
            if health.status_code == 503:
                starting.append(health.json())
            time.sleep(0.02)
        assert starting and all(body["status"] == "starting" and "phase" in body for body in starting)
        phases = {body["phase"] for body in starting} - {None}  # None: between two phases
        assert phases and phases <= {e["phase"] for e in daemon.events("startup phase")}, phases
        samples = httpx.get(f"http://{address}/metrics", timeout=10).text
        counted = [
            sample.value
            for family in text_string_to_metric_families(samples)
            for sample in family.samples
            if sample.name == "adaspec_http_requests_total"
            and sample.labels == {"endpoint": "/health", "status": "503"}
        ]
        assert counted == [len(starting)]
    finally:
        stop_daemon(daemon)
