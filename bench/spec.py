"""Run a workload against the engine in-process, once per mode, and compare them.

    python -m bench.spec --workload bench/workloads/transition.jsonl \\
        --modes none,static:1,static:3,static:7,adaptive:ema,adaptive:measured \\
        [--concurrency N] [--config FILE] [--json OUT] [--plot OUT.png]
    python -m bench.spec --workload bench/workloads/transition.jsonl --url http://127.0.0.1:8000 \\
        [--concurrency N] [--json OUT]

A workload is JSON Lines, one request per line: "prompt", "max_tokens", and optionally
"temperature", "top_p", "top_k", "seed", "stop", "phase" (a free label the report breaks results
down by) and "arrival_s" (open loop: not submitted before that offset). Without arrival times the
run is closed-loop: --concurrency requests in flight, the next one submitted as one finishes.

Modes: `none` (target only), `static:K` (a fixed k), `adaptive:positional`, `adaptive:measured`,
`adaptive:ema` (the config's [adaptive] parameters with that strategy, and that strategy's default
candidates where the config has the default; `+NAME=VALUE` overrides one more parameter or initial_k, as in
`adaptive:measured+exploration=0.01`); `+drafter=KIND`, `+verification=RULE`,
`+draft_quantization=int8|none`, `+eagle3=PATH` and `+dflash=PATH` (another EAGLE-3 head or DFlash
drafter, to compare them on the same target) change the engine's settings for that mode. Every mode
serves the same requests on the same loaded models in this process, side by side: the modes take
turns a round at a time, and each is timed by its own rounds, so a change in the machine's speed is
shared by all of them.
A round's wall time is shared among phases in proportion to the tokens each emitted in it, so
per-phase seconds add up to the total; the per-phase oracle serves each phase at the rate of that
phase's fastest static mode.

With --url the same workload goes through a running daemon's HTTP API (/v1/completions, one
client thread per request in flight) and the report has one row, "server": whatever the daemon
runs (restart it with another config to compare modes; bench/http_api.py does that). Tokens come
from each response's usage, accepted drafts from its "adaspec" field, rounds by k and switches
from /metrics. A phase's seconds are the wall time shared equally among the requests in flight
at each moment.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cache, partial
from pathlib import Path

from control.arguments import at_least
from control.issues import ConfigError
from control.load import load_config
from control.schema import DEFAULT_CANDIDATES
from control.snapshot import ConfigSnapshot
from daemon import runtime
from daemon.logs import configure_logging
from daemon.runtime import Models, load_models
from engine.config import DRAFT_QUANTIZATIONS, DRAFTERS, CheckpointError
from engine.controller import Controller
from engine.device import DeviceError
from engine.dflash import DFlashModel, load_dflash
from engine.eagle3 import Eagle3Model, load_eagle3
from engine.model import Transformer
from engine.policy import PolicyParams
from engine.request import Request
from engine.sampling import SamplingParams
from engine.verify import CHAIN_RULES

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class WorkItem:
    prompt: str
    params: SamplingParams
    phase: str
    arrival_s: float | None


WORKLOAD_KEYS = frozenset(
    {"prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "phase", "arrival_s"}
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
            items.append(WorkItem(str(raw["prompt"]), params, str(raw.get("phase", "all")), raw.get("arrival_s")))
        except (KeyError, ValueError, TypeError) as err:
            raise SystemExit(f"{path}:{number}: bad request ({err})") from None
    if not items:
        raise SystemExit(f"{path}: no requests")
    return items


@dataclass
class ModeReport:
    tokens: int = 0
    seconds: float = 0.0
    verified: int = 0  # request-rounds
    accepted: int = 0
    switches: int = 0
    k_rounds: Counter = field(default_factory=Counter)
    # Where the rounds' seconds went, from the engine's own timings; the rest is the round's own work.
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    phase_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    phase_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, k, tokens)
    runs: list[float] = field(default_factory=list)  # tokens/s of each run merged in

    def merge(self, other: ModeReport) -> None:
        """Add another run of the same mode (its timeline is kept, offset to follow this one)."""
        self.runs.extend(other.runs or [other.tokens / max(other.seconds, 1e-9)])
        offset = self.seconds
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.verified += other.verified
        self.accepted += other.accepted
        self.switches += other.switches
        self.k_rounds.update(other.k_rounds)
        self.prefill_seconds += other.prefill_seconds
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        for phase in other.phase_tokens:
            self.phase_tokens[phase] += other.phase_tokens[phase]
            self.phase_seconds[phase] += other.phase_seconds[phase]
        self.timeline.extend((t + offset, k, n) for t, k, n in other.timeline)

    def round_ms(self) -> dict[str, float]:
        """Milliseconds a round (in-process modes): drafting, the verify forward, and the rest of
        the round (accepting, the drafter's extend, bookkeeping), prefill left out."""
        rounds = max(sum(self.k_rounds.values()), 1)
        rest = self.seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds
        parts = {"draft": self.draft_seconds, "verify": self.verify_seconds, "rest": max(rest, 0.0)}
        return {name: 1e3 * seconds / rounds for name, seconds in parts.items()}

    def as_json(self) -> dict:
        return {
            "tokens_per_s": self.tokens / self.seconds,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "mean_accepted_drafts": self.accepted / max(self.verified, 1),
            "switches": self.switches,
            "runs_tokens_per_s": list(self.runs),
            "k_histogram": {str(k): n for k, n in sorted(self.k_rounds.items())},
            "round_ms": self.round_ms(),
            "prefill_seconds": self.prefill_seconds,
            "phases": {
                phase: {
                    "tokens_per_s": self.phase_tokens[phase] / max(self.phase_seconds[phase], 1e-9),
                    "tokens": self.phase_tokens[phase],
                    "seconds": self.phase_seconds[phase],
                }
                for phase in self.phase_tokens
            },
        }


def mode_snapshot(snapshot: ConfigSnapshot, mode: str) -> ConfigSnapshot:
    """The config a mode runs with: the daemon's, with drafting off (`none`), k fixed
    (`static:K`) or another strategy (`adaptive:NAME`), and any `+NAME=VALUE` overrides."""
    base, *overrides = mode.split("+")
    settings = dict(parse_override(o) for o in overrides)
    # The engine's own settings; every other override names a policy parameter.
    engine = replace(snapshot.engine, **{key: settings.pop(key) for key in ENGINE_OVERRIDES if key in settings})
    adaptive = snapshot.adaptive
    params = adaptive.policy
    if base == "none":
        engine = replace(engine, drafter="none")
    elif base.startswith("static:") and base[7:].isdigit() and not settings:
        k = int(base[7:])
        static = replace(params, candidate_k=(k,), slots=())
        adaptive = replace(adaptive, enabled=False, static_k=k, initial_k=k, policy=static)
    elif base.startswith("adaptive:") and base[9:] in DEFAULT_CANDIDATES:
        strategy = base[9:]
        if params.candidate_k == DEFAULT_CANDIDATES[params.strategy]:
            # The config left the candidates to its strategy: another strategy runs its own.
            settings.setdefault("candidate_k", DEFAULT_CANDIDATES[strategy])
        initial_k = settings.pop("initial_k", adaptive.initial_k)
        try:
            policy = replace(params, strategy=strategy, **settings)
        except ValueError as err:
            raise SystemExit(f"{mode!r}: {err}") from None
        adaptive = replace(adaptive, enabled=True, initial_k=initial_k, policy=policy)
    else:
        strategies = ", ".join(f"adaptive:{name}" for name in DEFAULT_CANDIDATES)
        raise SystemExit(f"unknown mode {mode!r}: none, static:K or {strategies}")
    return replace(snapshot, engine=engine, adaptive=adaptive)


def build_controller(
    mode: str, snapshot: ConfigSnapshot, models: Models, concurrency: int, max_seq_len: int
) -> Controller:
    """The engine a mode runs, assembled as the daemon assembles its own, `concurrency` slots wide."""
    settings = mode_snapshot(snapshot, mode)
    try:
        for kind in NAMED_DRAFTERS:  # +eagle3=PATH, +dflash=PATH: that drafter, on the loaded target
            path = getattr(settings.engine, kind)
            if path is not None and path != getattr(snapshot.engine, kind):
                models = replace(models, **{kind: named_drafter(kind, path, models.target.model)})
        return runtime.build_controller(settings, models, max_batch_size=concurrency, max_seq_len=max_seq_len)
    except (CheckpointError, ValueError) as err:  # a drafter not in place, a k no state can have
        raise SystemExit(f"mode {mode!r}: {err}") from None


# The drafters a mode may name by path, and how each loads on the target.
NAMED_DRAFTERS = {"eagle3": load_eagle3, "dflash": load_dflash}


@cache
def named_drafter(kind: str, path: Path, target: Transformer) -> Eagle3Model | DFlashModel:
    """The EAGLE-3 head or DFlash drafter a mode names, loaded once: every run of the mode shares
    it, as the config's drafters are shared (daemon.runtime.Models)."""
    return NAMED_DRAFTERS[kind](path, target)


ENGINE_OVERRIDES = ("verification", "drafter", "draft_quantization", *NAMED_DRAFTERS)


def drafters_of(modes: list[str]) -> set[str]:
    """The drafter kinds that modes name with +drafter=KIND (their models must be loaded)."""
    return {part.split("=", 1)[1] for mode in modes for part in mode.split("+")[1:] if part.startswith("drafter=")}


def parse_override(text: str) -> tuple[str, object]:
    """`name=value` of a policy parameter or of `initial_k`, as in adaptive:measured+exploration=0.01,
    or of the engine's `verification`, `drafter` or `draft_quantization` (any mode:
    static:3+verification=token); a list of step counts is written with slashes: candidate_k=0/3/7."""
    name, _, value = text.partition("=")
    if name == "verification" and value in CHAIN_RULES:
        return name, value
    if name == "drafter" and value in DRAFTERS:
        return name, value
    if name == "draft_quantization" and value in DRAFT_QUANTIZATIONS:
        return name, value
    if name in NAMED_DRAFTERS and value:
        return name, Path(value)
    if name not in (*PolicyParams.__dataclass_fields__, "initial_k") or not value:
        raise SystemExit(
            f"{text!r}: expected PARAMETER=VALUE with a policy parameter name, "
            f"verification={'|'.join(CHAIN_RULES)}, drafter={'|'.join(DRAFTERS)} "
            f"draft_quantization={'|'.join(DRAFT_QUANTIZATIONS)}, eagle3=PATH or dflash=PATH"
        )
    if name == "candidate_k":
        try:
            return name, tuple(int(k) for k in value.split("/"))
        except ValueError:
            raise SystemExit(f"{text!r}: expected draft lengths separated by '/'") from None
    lowered = value.lower()
    if lowered in ("true", "false"):
        return name, lowered == "true"
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, value


class ModeRun:
    """One mode serving the workload a round at a time, on its own clock: the wall time of its
    own rounds (and, open loop, of waiting for the next arrival while it has nothing to do)."""

    def __init__(self, controller: Controller, items: list[WorkItem], tokenizer, concurrency: int) -> None:
        self.controller = controller
        self.concurrency = concurrency
        self.report = ModeReport()
        requests = [Request(tuple(tokenizer.encode(i.prompt).ids), i.params) for i in items]
        self.phase_of = {r.id: i.phase for r, i in zip(requests, items)}
        self.open_loop = any(i.arrival_s is not None for i in items)
        self.queue = list(zip(requests, items))
        self.in_flight = 0
        self.clock = 0.0

    @property
    def done(self) -> bool:
        return not self.queue and not self.controller.engine.has_work

    def advance(self) -> None:
        """Submit what is due, then run one round."""
        engine, report = self.controller.engine, self.report
        while self.queue and (
            (self.open_loop and (self.queue[0][1].arrival_s or 0.0) <= self.clock)
            or (not self.open_loop and self.in_flight < self.concurrency)
        ):
            engine.add_request(self.queue.pop(0)[0])
            self.in_flight += 1
        if not engine.has_work:
            self.clock = max(self.clock, self.queue[0][1].arrival_s or 0.0)  # idle until the next arrival
            report.seconds = self.clock
            return
        started = time.perf_counter()
        result = self.controller.step()
        round_seconds = time.perf_counter() - started
        self.clock += round_seconds
        emitted: dict[str, int] = defaultdict(int)
        for out in result.outputs:
            emitted[self.phase_of[out.request_id]] += len(out.new_tokens)
            if out.verified:
                report.verified += 1
                report.accepted += out.drafts_accepted
            if out.finish_reason is not None:
                self.in_flight -= 1
        total = sum(emitted.values())
        for phase, n in emitted.items():
            report.phase_tokens[phase] += n
            report.phase_seconds[phase] += round_seconds * n / total
        report.tokens += total
        if result.batch_size:
            report.k_rounds[result.k] += 1
        report.prefill_seconds += result.prefill_seconds
        report.draft_seconds += result.draft_seconds
        report.verify_seconds += result.verify_seconds
        report.timeline.append((self.clock, result.k, total))
        report.seconds = self.clock
        report.switches = self.controller.switches


def run_side_by_side(runs: list[ModeRun]) -> None:
    """Run the modes in lockstep, one round of each in turn, until every one has served the
    workload. A drift of the machine's speed (another tenant, the clock) lasts far longer than a
    round, so it lands on every mode alike instead of on whichever mode ran at the time. Each turn
    starts one mode further on: the same mode first in every turn served about 1% slower than
    the same mode third (three copies of one mode, 3 runs), a bias as large as what is measured."""
    for turn in itertools.count():
        live = [run for run in runs if not run.done]
        if not live:
            return
        first = turn % len(live)
        for run in live[first:] + live[:first]:
            run.advance()


def run_modes(
    modes: list[str],
    items: list[WorkItem],
    snapshot: ConfigSnapshot,
    models: Models,
    concurrency: int,
    max_seq_len: int,
    repeats: int = 1,
) -> dict[str, ModeReport]:
    """Serve `items` with every mode side by side, `repeats` times over, each time on new engines."""
    factories = {mode: partial(build_controller, mode, snapshot, models, concurrency, max_seq_len) for mode in modes}
    return run_controllers(factories, items, models.target.tokenizer, concurrency, repeats)


def run_controllers(
    factories: dict[str, Callable[[], Controller]], items: list[WorkItem], tokenizer, concurrency: int, repeats: int
) -> dict[str, ModeReport]:
    """Serve `items` with the controller each factory builds, side by side, `repeats` times over,
    each time on new engines; reports by factory name."""
    reports = {name: ModeReport() for name in factories}
    for repeat in range(repeats):
        runs = {name: ModeRun(build(), items, tokenizer, concurrency) for name, build in factories.items()}
        run_side_by_side(list(runs.values()))
        for name, run in runs.items():
            reports[name].merge(run.report)
            print(f"  {name} (run {repeat + 1}): {run.report.tokens / run.report.seconds:.1f} tok/s", file=sys.stderr)
    return reports


def write_reports(path: Path, reports: dict[str, ModeReport]) -> None:
    path.write_text(json.dumps({"modes": {m: r.as_json() for m, r in reports.items()}}, indent=2) + "\n")


def run_mode(controller: Controller, items: list[WorkItem], tokenizer, concurrency: int) -> ModeReport:
    run = ModeRun(controller, items, tokenizer, concurrency)
    run_side_by_side([run])
    return run.report


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


def print_table(reports: dict[str, ModeReport]) -> None:
    baseline = reports.get("none")
    phases = sorted({p for r in reports.values() for p in r.phase_tokens})
    header = f"{'mode':<18} {'tok/s':>8} {'x none':>7} {'acc/round':>9} {'switches':>8}  " + " ".join(
        f"{p + ' tok/s':>14}" for p in phases
    )
    print(header)
    for mode, r in reports.items():
        ratio = f"{(r.tokens / r.seconds) / (baseline.tokens / baseline.seconds):.2f}x" if baseline else "-"
        per_phase = " ".join(f"{r.phase_tokens[p] / max(r.phase_seconds[p], 1e-9):>14.1f}" for p in phases)
        print(
            f"{mode:<18} {r.tokens / r.seconds:>8.1f} {ratio:>7} {r.accepted / max(r.verified, 1):>9.2f} "
            f"{r.switches:>8}  {per_phase}"
        )
    for mode, r in reports.items():
        histogram = " ".join(f"k={k}:{n}" for k, n in sorted(r.k_rounds.items()))
        print(f"  {mode:<16} rounds by k: {histogram}")
    for mode, r in reports.items():
        if r.draft_seconds or r.verify_seconds:  # in-process: the engine timed its phases
            ms = r.round_ms()
            print(
                f"  {mode:<16} ms a round: draft {ms['draft']:.3f}, verify {ms['verify']:.3f}, "
                f"rest {ms['rest']:.3f}; prefill {r.prefill_seconds:.2f} s in all"
            )
    # `none` is static k = 0: a policy that turns speculation off must beat it too.
    statics = {m: r for m, r in reports.items() if m == "none" or m.startswith("static:")}
    if statics:
        best_mode = max(statics, key=lambda m: statics[m].tokens / statics[m].seconds)
        best = statics[best_mode].tokens / statics[best_mode].seconds
        oracle, fastest = per_phase_oracle(statics, phases)
        picks = ", ".join(f"{p}: {fastest[p]}" for p in phases)
        print(f"best static: {best_mode} {best:.1f} tok/s; per-phase oracle: {oracle:.1f} tok/s ({picks})")
        for mode, r in reports.items():
            if mode.startswith("adaptive:"):
                rate = r.tokens / r.seconds
                # Run by run against the same static mode, run side by side with it: their spread
                # is the noise a single figure carries.
                runs = [a / b for a, b in zip(r.runs, statics[best_mode].runs)]
                spread = f" (runs {', '.join(f'{x:.3f}' for x in runs)})" if len(runs) > 1 else ""
                print(f"  {mode}: {rate / best:.3f}x best static{spread}, {rate / oracle:.3f}x per-phase oracle")


def phase_rate(report: ModeReport, phase: str) -> float:
    return report.phase_tokens[phase] / max(report.phase_seconds[phase], 1e-9)


def per_phase_oracle(statics: dict[str, ModeReport], phases: list[str]) -> tuple[float, dict[str, str]]:
    """Tokens/s of serving each phase with its fastest static mode, and those modes by phase.

    Sampled requests may stop at EOS sooner in one mode than in another, so phases are compared
    by rate: the oracle serves each phase's tokens (their mean over the modes) at that phase's
    best static rate."""
    fastest = {p: max(statics, key=lambda m: phase_rate(statics[m], p)) for p in phases}
    tokens = {p: sum(r.phase_tokens[p] for r in statics.values()) / len(statics) for p in phases}
    oracle = sum(tokens.values()) / sum(tokens[p] / phase_rate(statics[fastest[p]], p) for p in phases)
    return oracle, fastest


def plot(reports: dict[str, ModeReport], out: Path, window: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_k, ax_rate) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for mode, r in reports.items():
        times = [t for t, _, _ in r.timeline]
        ax_k.step(times, [k for _, k, _ in r.timeline], where="post", label=mode, linewidth=1)
        rates, start, acc = [], 0, 0
        for t, _, n in r.timeline:
            acc += n
            while r.timeline[start][0] < t - window:
                acc -= r.timeline[start][2]
                start += 1
            rates.append(acc / window if t >= window else acc / max(t, 1e-9))
        ax_rate.plot(times, rates, label=mode, linewidth=1)
    ax_k.set_ylabel("draft length k")
    ax_rate.set_ylabel(f"tokens/s ({window:.0f} s window)")
    ax_rate.set_xlabel("seconds")
    ax_k.legend(fontsize="small", ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--modes", default="none,static:1,static:3,static:7,adaptive:ema,adaptive:measured")
    parser.add_argument("--concurrency", type=at_least(1), default=1)
    parser.add_argument(
        "--config",
        type=Path,
        default=ROOT / "config.toml",
        help="TOML config: its [engine] and [adaptive] (the daemon's default)",
    )
    parser.add_argument("--target", default=None, help="target checkpoint (default: config, or models/target)")
    parser.add_argument("--draft", default=None, help="draft checkpoint (default: config, or models/draft)")
    parser.add_argument("--drafter", choices=DRAFTERS[:-1], default=None)
    parser.add_argument("--max-seq-len", type=at_least(2), default=1024)
    parser.add_argument(
        "--repeats", type=at_least(1), default=2, help="runs of all the modes side by side; figures add up"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--url", default=None, help="a running daemon's HTTP API instead of in-process modes")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    for out in (args.json, args.plot):  # before the run, not after it
        if out is not None and not out.parent.is_dir():
            parser.error(f"{out}: no folder {out.parent} to write it in")

    items = read_workload(args.workload)
    if args.url:
        if args.plot:
            parser.error("--plot needs the in-process modes: the HTTP API reports no per-round timeline")
        print(f"workload {args.workload} ({len(items)} requests) through {args.url}, concurrency {args.concurrency}")
        import httpx

        try:
            reports = {"server": run_url(args.url, items, args.concurrency)}
        except httpx.TransportError as err:  # nothing listening there, a timeout, ...
            raise SystemExit(f"{parser.prog}: {args.url}: {err}") from None
        print_table(reports)
        if args.json:
            write_reports(args.json, reports)
        return

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        snapshot = bench_snapshot(args)
        models = load_models(snapshot, kinds=drafters_of(modes))
    except (ConfigError, CheckpointError, DeviceError) as err:
        raise SystemExit(f"{parser.prog}: {err}") from None
    print(
        f"workload {args.workload} ({len(items)} requests), concurrency {args.concurrency}, "
        f"drafter {snapshot.engine.drafter}, candidates {list(snapshot.adaptive.policy.candidate_k)}",
        file=sys.stderr,
    )
    warm_up(snapshot, models, items, args.concurrency, args.max_seq_len)
    reports = run_modes(modes, items, snapshot, models, args.concurrency, args.max_seq_len, args.repeats)
    print_table(reports)
    if args.json:
        write_reports(args.json, reports)
    if args.plot:
        plot(reports, args.plot, window=max(1.0, max(r.seconds for r in reports.values()) / 40))


def bench_snapshot(args: argparse.Namespace) -> ConfigSnapshot:
    """The config a bench runs (--config, by default the daemon's), with --target, --draft and
    --drafter over it, so that a bench measures what the daemon serves; logging is set up as the
    daemon sets it up, so that events below its level (the policy's own switches) are dropped, not
    written out in the middle of the rounds being timed."""
    snapshot = load_config(args.config)
    configure_logging(snapshot.logging.level, snapshot.logging.format, cache=False)
    engine = snapshot.engine
    if args.target is not None:
        engine = replace(engine, target=Path(args.target))
    if args.draft is not None:
        engine = replace(engine, draft=Path(args.draft))
    if args.drafter is not None:
        engine = replace(engine, drafter=args.drafter)
    return replace(snapshot, engine=engine)


def warm_up(
    snapshot: ConfigSnapshot, models: Models, items: list[WorkItem], concurrency: int, max_seq_len: int
) -> None:
    """Run the kernels once, so that the first mode is not charged for it, then freeze the
    collector's view of start-up's objects as the daemon does."""
    warm = build_controller("static:1", snapshot, models, concurrency, max_seq_len)
    run_mode(warm, items[:1], models.target.tokenizer, 1)
    gc.freeze()


if __name__ == "__main__":
    main()
