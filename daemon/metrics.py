"""Prometheus metrics, served at GET /metrics from a registry of the daemon's own.

Each number is taken where it is cheapest to get right:
- HTTP requests and their latency: an ASGI middleware; time to first token: the server;
- tokens, rounds, accepted drafts, acceptance by draft position and drafts the confidence floor
  left unverified: each StepResult, and k
  switches by reason: the controller, both on the engine thread (prometheus_client's metrics are
  thread-safe, and a handful of increments per round cost microseconds);
- what is state rather than events (current k, in-flight requests, config generation, reload
  failures, runtime states): read when scraped, so it can never drift from the daemon's own.

Acceptance at draft position j (1 = the first draft of a round) is
rate(adaspec_draft_position_accepted_total{position="j"}) / rate(..._proposed_total{position="j"}).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from daemon.reload import Reloader
from engine.core import StepResult
from engine.loop import EngineLoop

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)


class Metrics:
    def __init__(self, max_k: int) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "adaspec_http_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "adaspec_http_request_duration_seconds",
            "Time from a request to the end of its response, by endpoint",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.first_token = Histogram(
            "adaspec_time_to_first_token_seconds",
            "Time from a generation request to its first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter("adaspec_generated_tokens", "Tokens generated", registry=registry)
        self.rounds = Counter("adaspec_rounds", "Speculative rounds run, by draft length k", ["k"], registry=registry)
        self.sequence_rounds = Counter(
            "adaspec_sequence_rounds",
            "Sequences' rounds, by the draft length each drafted (with per_sequence, rows of a round differ)",
            ["k"],
            registry=registry,
        )
        self.accepted = Histogram(
            "adaspec_accepted_drafts",
            "Drafts accepted per sequence per round",
            buckets=tuple(range(max_k + 1)),
            registry=registry,
        )
        self.proposed_at = Counter(
            "adaspec_draft_position_proposed",
            "Drafts proposed at each position of a round's chain (1 = first)",
            ["position"],
            registry=registry,
        )
        self.accepted_at = Counter(
            "adaspec_draft_position_accepted",
            "Drafts accepted at each position of a round's chain (1 = first)",
            ["position"],
            registry=registry,
        )
        self.trimmed = Counter(
            "adaspec_trimmed_drafts",
            "Drafts left unverified because the drafter was unsure of them (adaptive.draft_confidence)",
            registry=registry,
        )
        self.switches = Counter("adaspec_switches", "Draft-length switches, by reason", ["reason"], registry=registry)
        self.prefill_tokens = Counter(
            "adaspec_prefill_tokens",
            "Prompt tokens prefilled, by path: graph (piecewise graphs, CUDA) or eager",
            ["path"],
            registry=registry,
        )
        self.prefill_fallbacks = Counter(
            "adaspec_prefill_fallbacks",
            "Prefills run eagerly where prefill graphs exist, by the guard that refused them: tokens (more"
            " than the largest bucket), rows, capture (other hidden-state taps), overflow",
            ["reason"],
            registry=registry,
        )

    def watch(self, loop: EngineLoop, reloader: Reloader) -> None:
        """Report the running daemon's state at every scrape."""
        self.registry.register(_StateCollector(loop, reloader))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the engine thread ---------------------------------------------------------------

    def observe_step(self, result: StepResult) -> None:
        tokens = sum(len(out.new_tokens) for out in result.outputs)
        if tokens:
            self.tokens.inc(tokens)
        if result.batch_size:
            self.rounds.labels(str(result.k)).inc()
        if result.drafts_trimmed:
            self.trimmed.inc(result.drafts_trimmed)
        if result.prefill_tokens:
            self.prefill_tokens.labels("graph" if result.prefill_graphed else "eager").inc(result.prefill_tokens)
        if result.prefill_fallback is not None:
            self.prefill_fallbacks.labels(result.prefill_fallback).inc()
        # Drafts are kept as a prefix: a sequence that proposed p and kept a covers positions
        # 1..p proposed and 1..a accepted. Summed per position first: one increment each.
        proposed = [0] * (result.k + 1)
        accepted = [0] * (result.k + 1)
        lengths = [0] * (result.k + 1)
        for out in result.outputs:
            if not out.verified:
                continue
            lengths[min(out.drafts_proposed, result.k)] += 1
            self.accepted.observe(out.drafts_accepted)
            for position in range(1, out.drafts_proposed + 1):
                proposed[position] += 1
                accepted[position] += position <= out.drafts_accepted
        for k, rows in enumerate(lengths):
            if rows:
                self.sequence_rounds.labels(str(k)).inc(rows)
        for position in range(1, result.k + 1):
            if proposed[position]:
                self.proposed_at.labels(str(position)).inc(proposed[position])
            if accepted[position]:
                self.accepted_at.labels(str(position)).inc(accepted[position])

    def observe_switch(self, old: int, new: int, reason: str) -> None:
        self.switches.labels(reason).inc()


class _StateCollector(Collector):
    def __init__(self, loop: EngineLoop, reloader: Reloader) -> None:
        self.loop = loop
        self.reloader = reloader

    def collect(self) -> Iterable[Metric]:
        loop, status = self.loop, self.loop.status
        yield GaugeMetricFamily("adaspec_k", "Draft length k the next round runs with", value=status.k)
        if status.threads is not None:
            yield GaugeMetricFamily("adaspec_threads", "Threads the compiled CPU forward runs on", value=status.threads)
            yield CounterMetricFamily(
                "adaspec_thread_switches", "Changes of the thread count served", value=status.thread_switches
            )
        yield GaugeMetricFamily(
            "adaspec_requests_in_flight",
            "Requests submitted and not finished (running and queued)",
            value=loop.in_flight,
        )
        yield GaugeMetricFamily("adaspec_running_sequences", "Sequences in the batch", value=status.running)
        yield GaugeMetricFamily(
            "adaspec_config_generation",
            "Generation of the configuration in force",
            value=self.reloader.snapshot.generation,
        )
        yield CounterMetricFamily(
            "adaspec_config_reload_failures",
            "Reloads rejected (the previous config stayed)",
            value=self.reloader.failures,
        )
        build = GaugeMetricFamily(
            "adaspec_runtime_state_build_seconds", "Time taken to build the runtime state for k", labels=["k"]
        )
        memory = GaugeMetricFamily(
            "adaspec_runtime_state_memory_bytes",
            "Device memory held by the runtime state for k (its captured graphs), in bytes; "
            "not measured on a CPU, where it reads 0",
            labels=["k"],
        )
        for state in status.states:
            build.add_metric([str(state.k)], state.build_seconds)
            memory.add_metric([str(state.k)], state.memory_bytes)
        yield build
        yield memory


CLIENT_CLOSED = 499  # nginx's status for "the client went away first": only ever seen in metrics


class MetricsMiddleware:
    """Counts every HTTP request by endpoint and status, and times it to the end of its body."""

    def __init__(self, app: ASGIApp, metrics: Metrics, endpoints: Iterable[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)  # any other path is "other": labels stay bounded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        started = time.perf_counter()
        status = 500  # what the client gets if the app fails before it answers
        answering = finished = False

        async def send_and_note(message: Message) -> None:
            nonlocal status, answering, finished
            if message["type"] == "http.response.start":
                status, answering = message["status"], True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            status = 500  # failed, maybe after its 200 went out
            raise
        else:
            # A response begun and never ended, with no failure, is a stream its client left.
            if answering and not finished:
                status = CLIENT_CLOSED
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
