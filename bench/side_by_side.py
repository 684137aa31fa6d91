"""Serving a workload in-process with several engines side by side, a round of each in turn."""

from __future__ import annotations

import itertools
import sys
import time
from collections import defaultdict
from collections.abc import Callable

from bench.report import ModeReport
from bench.workload import WorkItem, reseeded
from engine.controller import Controller
from engine.request import Request


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
            or (not self.open_loop and self.in_flight < (self.queue[0][1].concurrency or self.concurrency))
        ):
            engine.add_request(self.queue.pop(0)[0])
            self.in_flight += 1
        if not engine.has_work:
            self.clock = max(self.clock, self.queue[0][1].arrival_s or 0.0)  # idle until the next arrival
            report.seconds = self.clock
            return
        policy = self.controller.policy
        tried = self.controller.mode_name == "adaptive" and self.controller.k != policy.serving
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
        if result.batch_size:
            report.rounds.append((result.k, total, round_seconds - result.prefill_seconds, tried))
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


def run_controllers(
    factories: dict[str, Callable[[], Controller]], items: list[WorkItem], tokenizer, concurrency: int, repeats: int
) -> dict[str, ModeReport]:
    """Serve `items` with the controller each factory builds, side by side, `repeats` times over,
    each time on new engines and with new seeds for sampled requests (`reseeded`); reports by
    factory name."""
    reports = {name: ModeReport() for name in factories}
    for repeat in range(repeats):
        served = reseeded(items, repeat)
        runs = {name: ModeRun(build(), served, tokenizer, concurrency) for name, build in factories.items()}
        run_side_by_side(list(runs.values()))
        for name, run in runs.items():
            reports[name].merge(run.report)
            print(f"  {name} (run {repeat + 1}): {run.report.tokens / run.report.seconds:.1f} tok/s", file=sys.stderr)
    return reports


def run_mode(controller: Controller, items: list[WorkItem], tokenizer, concurrency: int) -> ModeReport:
    run = ModeRun(controller, items, tokenizer, concurrency)
    run_side_by_side([run])
    return run.report
