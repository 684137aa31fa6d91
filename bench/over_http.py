"""Serving a workload through a running daemon's HTTP API (`python -m bench.spec --url`)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

from bench.report import ModeReport
from bench.workload import WorkItem


def run_url(url: str, items: list[WorkItem], concurrency: int, timeout: float = 600.0) -> ModeReport:
    """Serve `items` through the HTTP API at `url`: closed loop with `concurrency` clients, or open
    loop when the workload has arrival times."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(client: httpx.Client) -> Counter[tuple[str, str]]:
        """Rounds by k, and switches (of every reason) under k = ""."""
        totals: Counter[tuple[str, str]] = Counter()
        for family in text_string_to_metric_families(client.get("/metrics").raise_for_status().text):
            for sample in family.samples:
                if sample.name in ("adaspec_rounds_total", "adaspec_switches_total"):
                    totals[sample.name, sample.labels.get("k", "")] += sample.value
        return totals

    report = ModeReport()
    open_loop = any(i.arrival_s is not None for i in items)
    with httpx.Client(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=len(items))) as client:
        before = scrape(client)
        started = time.perf_counter()

        def serve(item: WorkItem) -> tuple[float, float, dict]:
            if open_loop:
                time.sleep(max(0.0, (item.arrival_s or 0.0) - (time.perf_counter() - started)))
            sent = time.perf_counter() - started
            body = client.post("/v1/completions", json=completion_body(item)).raise_for_status().json()
            return sent, time.perf_counter() - started, body

        with ThreadPoolExecutor(len(items) if open_loop else concurrency) as pool:
            served = list(pool.map(serve, items))
        report.seconds = time.perf_counter() - started
        after = scrape(client)
    for item, (_, _, body) in zip(items, served):
        report.tokens += body["usage"]["completion_tokens"]
        report.phase_tokens[item.phase] += body["usage"]["completion_tokens"]
        report.verified += body["adaspec"]["rounds"]
        report.accepted += body["adaspec"]["accepted_drafts"]
    report.phase_seconds.update(share_by_phase([(sent, done, i.phase) for i, (sent, done, _) in zip(items, served)]))
    for (name, k), value in after.items():
        moved = round(value - before[name, k])
        if name == "adaspec_rounds_total" and moved:
            report.k_rounds[int(k)] += moved
        elif name == "adaspec_switches_total":
            report.switches += moved
    return report


def completion_body(item: WorkItem) -> dict:
    params = item.params
    body = {"prompt": item.prompt, "max_tokens": params.max_tokens, "temperature": params.temperature}
    body |= {"top_p": params.top_p, "top_k": params.top_k, "seed": params.seed, "stop": list(params.stop) or None}
    return body


def share_by_phase(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Wall time per phase: each moment is shared equally among the requests in flight then."""
    seconds: dict[str, float] = defaultdict(float)
    moments = sorted({t for start, end, _ in spans for t in (start, end)})
    for a, b in zip(moments, moments[1:]):
        live = [phase for start, end, phase in spans if start <= a and end >= b]
        for phase in live:
            seconds[phase] += (b - a) / len(live)
    return seconds
