"""Tokens/s through the HTTP API: the adaptive policy against each static k, at 1, 4 and 16 clients.

    python -m bench.http_api [--workload bench/workloads/transition.jsonl] [--requests N]
        [--concurrency 1,4,16] [--steps 1,3,7] [--max-batch-size 16] [--in-process] [--json OUT]

One daemon per configuration, started on a free port and stopped after its runs: first the
shipped config.toml's [adaptive] section, then [adaptive] enabled = false with
static_k = K for each K. Each serves the same workload at every concurrency through
`bench.over_http.run_url` (closed loop: N clients, the next request sent as one finishes).
engine.max_batch_size is 16 by default so that 16 clients decode together.

With --in-process, after each daemon has stopped, the same config's engine serves the same
requests in this process as the daemon served them (one engine: the warm-up, then each
concurrency in turn, so that its lookups remember the same requests), and a second table gives
the daemon's tokens/s over the engine's own: what the HTTP API and the daemon around the engine
cost. The daemon once ran at 0.40x there (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import tomllib

from bench.over_http import run_url
from bench.report import ModeReport
from bench.spec import ROOT, bench_snapshot
from bench.workload import WorkItem, read_workload
from control.arguments import integers
from control.snapshot import ConfigSnapshot

CONFIG = """\
[engine]
target = "{root}/models/target"
draft = "{root}/models/draft"
max_batch_size = {max_batch_size}

[adaptive]
{adaptive}

[admin]
socket = "{folder}/admin.sock"

[server]
port = 0

[logging]
format = "json"
"""
START_TIMEOUT_S = 180
_MODELS: dict[object, Any] = {}  # [engine] section -> the models this process loaded for it


@dataclass(frozen=True)
class RunningDaemon:
    url: str  # the HTTP API
    config: Path
    socket: Path  # the admin socket
    log: Path


@contextmanager
def daemon(adaptive: str, max_batch_size: int) -> Iterator[RunningDaemon]:
    """A daemon whose [adaptive] section is `adaptive`, serving on a free port."""
    folder = Path(tempfile.mkdtemp(prefix="adaspec-bench-", dir="/tmp"))  # AF_UNIX paths must stay short
    config = folder / "config.toml"
    config.write_text(CONFIG.format(root=ROOT, folder=folder, adaptive=adaptive, max_batch_size=max_batch_size))
    log = folder / "daemon.log"
    command = [sys.executable, "-m", "daemon.cli", "--config", str(config)]
    with log.open("w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        yield RunningDaemon(f"http://{_ready_address(process, log)}", config, folder / "admin.sock", log)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        shutil.rmtree(folder, ignore_errors=True)  # a daemon that failed has had its log's tail printed


def _ready_address(process: subprocess.Popen, log: Path) -> str:
    """The HTTP address in the daemon's "ready" event (it is sent once every listener is bound)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("{") and (event := json.loads(line)).get("event") == "ready":
                return event["http"]
        if process.poll() is not None:
            raise SystemExit(f"the daemon exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    raise SystemExit(f"the daemon was not ready within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def warm_items(items: list[WorkItem], concurrencies: list[int]) -> list[WorkItem]:
    """Short requests that run the first forwards at each batch shape, charged to no measured run."""
    return [replace(item, params=replace(item.params, max_tokens=8)) for item in items[: max(concurrencies)]]


def measure(
    adaptive: str, items: list[WorkItem], concurrencies: list[int], max_batch_size: int, in_process: bool = False
) -> tuple[list[ModeReport], list[ModeReport]]:
    """The daemon's report at each concurrency, and with `in_process` the engine's own (else [])."""
    with daemon(adaptive, max_batch_size) as running:
        run_url(running.url, warm_items(items, concurrencies), max(concurrencies))
        served = [run_url(running.url, items, concurrency) for concurrency in concurrencies]
        config = bench_snapshot(argparse.Namespace(config=running.config, target=None, draft=None, drafter=None))
    engine = measure_in_process(config, items, concurrencies, max_batch_size) if in_process else []
    return served, engine


def measure_in_process(
    snapshot: ConfigSnapshot, items: list[WorkItem], concurrencies: list[int], max_batch_size: int
) -> list[ModeReport]:
    """The daemon's config served in this process as the daemon served it: one engine, the
    warm-up first, then each concurrency in turn; each report counts the engine's own rounds."""
    from bench.side_by_side import run_mode
    from bench.spec import build_controller
    from control.assemble import load_models

    if snapshot.engine not in _MODELS:  # every daemon here has the same [engine]: loaded once
        _MODELS[snapshot.engine] = load_models(snapshot)
    models = _MODELS[snapshot.engine]
    adaptive = snapshot.adaptive
    mode = f"adaptive:{adaptive.policy.strategy}" if adaptive.enabled else f"static:{adaptive.static_k}"
    controller = build_controller(mode, snapshot, models, max_batch_size, snapshot.engine.max_seq_len)
    tokenizer = models.target.tokenizer
    run_mode(controller, warm_items(items, concurrencies), tokenizer, max(concurrencies))
    return [run_mode(controller, items, tokenizer, concurrency) for concurrency in concurrencies]


def shipped_adaptive() -> str:
    """The [adaptive] section of the shipped config.toml, so that "adaptive" is what users run."""
    adaptive = tomllib.loads((ROOT / "config.toml").read_text()).get("adaptive", {})
    return "\n".join(
        f"{key} = {json.dumps(value)}"
        for key, value in adaptive.items()
        if not isinstance(value, list) or all(not isinstance(v, dict) for v in value)
    )


def rate(report: ModeReport) -> float:
    return report.tokens / report.seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, default=ROOT / "bench" / "workloads" / "transition.jsonl")
    parser.add_argument("--requests", type=int, default=None, help="only the first N requests of the workload")
    parser.add_argument(
        "--concurrency", type=integers(1), default=[1, 4, 16], help="numbers of clients, comma-separated"
    )
    parser.add_argument(
        "--k",
        "--steps",
        dest="k",
        type=integers(0),
        default=[1, 3, 7],
        help="the static k to compare with, comma-separated",
    )
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument(
        "--in-process", action="store_true", help="also serve each config in this process: the daemon over the engine"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line a request once logging is set up here

    items = read_workload(args.workload)[: args.requests]
    concurrencies = args.concurrency
    modes = {"adaptive": shipped_adaptive()}
    modes |= {f"static:{k}": f"enabled = false\nstatic_k = {k}" for k in args.k}
    print(f"workload {args.workload}: {len(items)} requests, concurrency {concurrencies}", file=sys.stderr)
    results: dict[str, list[ModeReport]] = {}
    engine: dict[str, list[ModeReport]] = {}
    for mode, adaptive in modes.items():
        results[mode], engine[mode] = measure(adaptive, items, concurrencies, args.max_batch_size, args.in_process)
        print(f"  {mode}: " + ", ".join(f"{rate(r):.1f}" for r in results[mode]) + " tok/s", file=sys.stderr)

    statics = [m for m in modes if m != "adaptive"]
    print(f"{'clients':>7} " + " ".join(f"{m:>10}" for m in modes) + f" {'best static':>12} {'adaptive/best':>13}")
    for i, concurrency in enumerate(concurrencies):
        best = max(statics, key=lambda m: rate(results[m][i]))
        adaptive = results["adaptive"][i]
        print(
            f"{concurrency:>7} "
            + " ".join(f"{rate(results[m][i]):>10.1f}" for m in modes)
            + f" {best:>12} {rate(adaptive) / rate(results[best][i]):>13.3f}"
        )
    for i, concurrency in enumerate(concurrencies):
        adaptive = results["adaptive"][i]
        rounds = " ".join(f"k={k}:{n}" for k, n in sorted(adaptive.k_rounds.items()))
        print(
            f"  adaptive at {concurrency} clients: {adaptive.accepted / max(adaptive.verified, 1):.2f} accepted "
            f"drafts per round, {adaptive.switches} switches, rounds by k: {rounds}"
        )
    if args.in_process:
        print("daemon over the same engine in this process (tokens/s: daemon / engine)")
        print(f"{'clients':>7} " + " ".join(f"{m:>22}" for m in modes))
        for i, concurrency in enumerate(concurrencies):
            cells = [
                f"{rate(results[m][i]):.0f} / {rate(engine[m][i]):.0f} {rate(results[m][i]) / rate(engine[m][i]):.2f}x"
                for m in modes
            ]
            print(f"{concurrency:>7} " + " ".join(f"{cell:>22}" for cell in cells))
    if args.json:
        out = {m: {str(c): r.as_json() for c, r in zip(concurrencies, reports)} for m, reports in results.items()}
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
