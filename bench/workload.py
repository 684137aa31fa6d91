"""A workload: JSON Lines, one request per line (the format is described in bench/spec.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from engine.sampling import SamplingParams


@dataclass(frozen=True)
class WorkItem:
    prompt: str
    params: SamplingParams
    phase: str
    arrival_s: float | None
    # Closed loop: requests in flight while this one waits to be sent (None: the run's concurrency).
    concurrency: int | None = None


WORKLOAD_KEYS = frozenset(
    {"prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "phase", "arrival_s", "concurrency"}
)


def read_workload(path: Path) -> list[WorkItem]:
    items = []
    try:
        text = path.read_text()
    except OSError as err:
        raise SystemExit(f"{path}: cannot read the workload ({err.strerror})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            if unknown := sorted(set(raw) - WORKLOAD_KEYS):  # a typo would run with a default
                raise ValueError(f"unknown key {unknown[0]!r}; a request has {', '.join(sorted(WORKLOAD_KEYS))}")
            if "prompt" not in raw:
                raise ValueError('no "prompt"')
            params = SamplingParams(
                max_tokens=int(raw.get("max_tokens", 128)),
                temperature=float(raw.get("temperature", 0.0)),
                top_k=int(raw.get("top_k", 0)),
                top_p=float(raw.get("top_p", 1.0)),
                seed=raw.get("seed"),
                stop=tuple([raw["stop"]] if isinstance(raw.get("stop"), str) else raw.get("stop") or ()),
            )
            concurrency = raw.get("concurrency")
            if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
                raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
            phase = str(raw.get("phase", "all"))
            items.append(WorkItem(str(raw["prompt"]), params, phase, raw.get("arrival_s"), concurrency))
        except (KeyError, ValueError, TypeError) as err:
            raise SystemExit(f"{path}:{number}: bad request ({err})") from None
    if not items:
        raise SystemExit(f"{path}: no requests")
    return items


def widest(items: list[WorkItem], concurrency: int) -> int:
    """The most requests a closed loop over `items` holds in flight at once."""
    return max([concurrency] + [i.concurrency for i in items if i.concurrency is not None])


SEED_STEP = 100_003  # how far each repeat moves a seed: a prime far beyond the seeds the suite's files hold


def reseeded(items: list[WorkItem], repeat: int) -> list[WorkItem]:
    """`items` with every sampled request's seed moved on by `repeat` (repeat 0: as written). A
    seeded sampled request's text depends on how many draws each k takes, so every mode writes a
    text of its own: 2-5% apart in kept drafts a round over a workload's 24 requests. New seeds a
    repeat make repeats average that luck out as well as the clock's."""
    if repeat == 0:
        return items
    return [
        replace(i, params=replace(i.params, seed=i.params.seed + repeat * SEED_STEP))
        if i.params.seed is not None and not i.params.greedy
        else i
        for i in items
    ]
