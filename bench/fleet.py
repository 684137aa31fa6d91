"""Replicas behind a router: load through sglang-router while the fleet is edited, pinned and broken.

    python -m bench.fleet [--replicas 3] [--clients 64] [--seconds 60] [--router PATH] [--json OUT]

Starts --replicas daemons on the default models (each with a config of its own, as bench.soak
starts one) and sglang-router in front of them (round robin, health checks every second,
retries on). First one daemon alone serves --clients clients for --seconds / 3 (the baseline),
then the fleet serves them through the router for --seconds, while, in turn: every replica's
config gets the same edit (the ema strategy, waited for until each applies it), `adaspecctl`
with every replica's socket pins k = 3 on the whole fleet and later unpins it, and the last
replica is killed (SIGKILL) and started again on its port. Clients are bench.soak's: completions
and chat, streaming and not, greedy and sampled, every greedy reply compared with target-only
output computed in this process.

Reports, for the baseline and the fleet: requests sent, completed, failed (by HTTP status),
mismatched, completion tokens/s; the router's retries (its Prometheus counters); each replica's
strategy, config generation and last reload at the end. On a machine with fewer cores than
replicas the fleet shares the cores the one daemon had: tokens/s there says what routing costs,
not what replicas gain. Exits 1 on a failure beyond the requests the killed replica held, a
mismatch, or a replica not on the edited config at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.soak import ROOT, Case, Tally, cases, client, launch, start
from control.arguments import above_zero, at_least
from control.ctl import request
from engine.parallel import free_port

ROUTER_ENV = "ADASPEC_ROUTER"  # where sglang-router is, where it is not on PATH (.ci/run sets it)


@dataclass
class Replica:
    folder: Path
    process: subprocess.Popen
    config: Path
    socket: Path
    address: tuple[str, int]

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}"

    def status(self) -> dict:
        return request(self.socket, "status", timeout=10)["result"]


def start_router(router: str, workers: list[str], folder: Path) -> tuple[subprocess.Popen, str, str]:
    """sglang-router in front of the daemons at `workers` (their URLs), logging to
    `folder`/router.log, once it serves a request: its process, its URL and its Prometheus URL."""
    port, metrics = free_port(), free_port()
    log = (folder / "router.log").open("w")
    command = [router, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
    command += ["--worker-urls", *workers, "--prometheus-port", str(metrics)]
    command += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    body = {"model": "target", "prompt": "def f(", "max_tokens": 2, "temperature": 0}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the router exited with {process.returncode}; see {folder / 'router.log'}")
        try:
            if httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200:
                return process, url, f"http://127.0.0.1:{metrics}/metrics"
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the router did not serve within 120 s; see {folder / 'router.log'}")


def retries(metrics_url: str) -> dict[str, float]:
    """The router's counters (`..._total`) whose names speak of retries, summed over their labels."""
    try:
        text = httpx.get(metrics_url, timeout=10).text
    except httpx.TransportError:
        return {}
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[-1]
        if line.startswith("#") or "retr" not in name or not name.endswith("_total"):
            continue
        found[name] = found.get(name, 0.0) + float(value)
    return found


def load(address: tuple[str, int], all_cases: list[Case], clients: int, seconds: float, seed: int) -> Tally:
    """--clients of bench.soak's clients against `address` for `seconds` (through a router, they
    name the model)."""
    tally, until = Tally(), time.monotonic() + seconds
    threads = [
        threading.Thread(target=client, args=(address, all_cases, until, 120.0, tally, seed + i, "target"))
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 200)
    return tally


def summary(tally: Tally, seconds: float) -> dict:
    return {
        "sent": tally.sent,
        "completed": tally.completed,
        "failed": dict(tally.failed),
        "hung": tally.hung,
        "mismatched": tally.mismatched,
        "tokens_per_s": round(tally.tokens / seconds, 1),
        "examples": tally.examples[:5],
    }


class Steering:
    """What happens to the fleet while it serves, each step at its share of the run."""

    def __init__(self, replicas: list[Replica], seconds: float) -> None:
        self.replicas, self.seconds = replicas, seconds
        self.log: list[str] = []
        self.problems: list[str] = []
        self.held_when_killed = 0  # requests in flight on the replica killed

    def at(self, share: float, started: float) -> None:
        time.sleep(max(0.0, started + share * self.seconds - time.monotonic()))

    def wait_for(self, replica: Replica, check: Callable[[dict], bool], what: str, within: float = 30.0) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if check(replica.status()):
                return
            time.sleep(0.1)
        self.problems.append(f"{replica.folder.name}: {what} not seen within {within:g} s")

    def edit_every_config(self) -> None:
        """The same edit on every replica's config file, as a config-management tool makes it."""
        for replica in self.replicas:
            generation = replica.status()["generation"]
            text = replica.config.read_text()
            replica.config.write_text(re.sub(r"(?m)^strategy = .*$", 'strategy = "ema"', text))
            self.wait_for(replica, lambda s, g=generation: s["generation"] == g + 1 and s["last_reload"]["ok"], "edit")
        self.log.append("every config: strategy = ema")

    def fleet_command(self, *argv: str) -> None:
        """adaspecctl with every replica's socket, as an operator runs it."""
        sockets = [arg for r in self.replicas for arg in ("--socket", str(r.socket))]
        done = subprocess.run(
            [sys.executable, "-m", "control.ctl", *sockets, *argv], cwd=ROOT, capture_output=True, text=True
        )
        self.log.append(f"adaspecctl {' '.join(argv)} on {len(self.replicas)} sockets: exit {done.returncode}")
        if done.returncode != 0:
            self.problems.append(f"adaspecctl {' '.join(argv)}: {done.stderr.strip()[-300:]}")
        mode = "pinned" if argv[0] == "pin" else "adaptive"
        for replica in self.replicas:
            self.wait_for(replica, lambda s: s["mode"] == mode, f"mode {mode} after {argv[0]}")

    def kill_and_restart(self, started: float) -> None:
        victim = self.replicas[-1]
        self.held_when_killed = victim.status()["in_flight"]
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait()
        self.log.append(f"{victim.folder.name} killed")
        self.at(0.75, started)
        text = victim.config.read_text()  # its edited config, on the port the router knows
        victim.config.write_text(re.sub(r"(?m)^port = .*$", f"port = {victim.address[1]}", text))
        victim.process, _, _, victim.address = launch(victim.folder)
        self.log.append(f"{victim.folder.name} started again")

    def run(self, started: float) -> None:
        try:
            self.at(0.15, started)
            self.edit_every_config()
            self.at(0.3, started)
            self.fleet_command("pin", "3")
            self.at(0.45, started)
            self.fleet_command("unpin")
            self.at(0.55, started)
            self.kill_and_restart(started)
        except (OSError, ValueError, KeyError, SystemExit) as err:
            self.problems.append(f"steering stopped: {err!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=at_least(2), default=3)
    parser.add_argument("--clients", type=at_least(1), default=64)
    parser.add_argument("--seconds", type=above_zero, default=60.0)
    parser.add_argument("--max-batch-size", type=at_least(1), default=8)
    parser.add_argument("--max-queue", type=at_least(1), default=64)
    parser.add_argument("--router", default=os.environ.get(ROUTER_ENV) or shutil.which("sglang-router"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.router:
        parser.error(
            f"sglang-router not found: pip install sglang-router==0.3.2, or name it with --router or ${ROUTER_ENV}"
        )

    all_cases = cases(ROOT / "models" / "target")
    folders = [Path(tempfile.mkdtemp(prefix=f"adaspec-fleet-{i}-", dir="/tmp")) for i in range(args.replicas)]
    replicas = [Replica(f, *start(f, args.max_batch_size, args.max_queue)) for f in folders]
    router = None
    try:
        baseline_seconds = args.seconds / 3
        alone = load(replicas[0].address, all_cases, args.clients, baseline_seconds, args.seed)
        router, url, metrics_url = start_router(args.router, [r.url for r in replicas], folders[0])
        before = retries(metrics_url)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        steering = Steering(replicas, args.seconds)
        started = time.monotonic()
        steer = threading.Thread(target=steering.run, args=(started,))
        steer.start()
        fleet = load((host, int(port)), all_cases, args.clients, args.seconds, args.seed + 1000)
        steer.join(300)
        after = retries(metrics_url)
        statuses = [r.status() for r in replicas]
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            router.wait(30)
        for replica in replicas:
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGTERM)
                replica.process.wait(60)
    report = {
        "replicas": args.replicas,
        "clients": args.clients,
        "seconds": args.seconds,
        "one_daemon": summary(alone, baseline_seconds),
        "fleet": summary(fleet, args.seconds),
        "router_retries": {name: after[name] - before.get(name, 0.0) for name in after},
        "steering": steering.log,
        "in_flight_on_the_killed_replica": steering.held_when_killed,
        "steering_problems": steering.problems,
        "replicas_at_end": [
            {
                "replica": r.folder.name,
                "strategy": s["strategy"],
                "mode": s["mode"],
                "generation": s["generation"],
                "last_reload_ok": s["last_reload"]["ok"],
            }
            for r, s in zip(replicas, statuses)
        ],
        "logs": [str(f) for f in folders],
    }
    report["fleet_over_one_daemon"] = round(
        report["fleet"]["tokens_per_s"] / max(report["one_daemon"]["tokens_per_s"], 1e-9), 3
    )
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    # What the killed replica held may fail where the router gives up on it; nothing else may.
    failed = sum(fleet.failed.values()) - fleet.mismatched + fleet.hung
    ok = (
        failed <= steering.held_when_killed
        and fleet.mismatched == 0
        and alone.mismatched == 0
        and not sum(alone.failed.values())
        and not steering.problems
        and all(s["strategy"] == "ema" and s["last_reload"]["ok"] for s in statuses)
        and fleet.completed > 0
    )
    print("fleet: " + ("ok" if ok else "FAILED"), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
