"""The thread count of the compiled CPU forward, chosen between rounds from measured rounds
(engine/policy/threads.py): what a user notices is that the engine keeps serving at speed when
another process takes a core, loses little when none does, and emits the same tokens whatever the
count."""

from __future__ import annotations

import random

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.core import Engine
from engine.drafters.draft_model import HybridDrafter
from engine.generate import generate
from engine.policy.threads import MAX_SPACING, ThreadPolicy, counts_below
from engine.request import Request
from engine.sampling import SamplingParams
from tests.conftest import DEFAULT_DRAFT, DEFAULT_TARGET


class Machine:
    """A simulated machine of two cores: what a round costs at each thread count, and the load the
    operating system reports. Idle, two threads are 1.6x as fast as one. Beside a busy process, a
    two-thread round mostly runs at speed, but one in eight waits out a scheduler turn of 30 ms
    (the team's threads wait for a core), while one thread runs steadily on the other core."""

    def __init__(self, seed: int = 0, report_load: bool = True, one_thread_speedup: float = 1.6) -> None:
        self.random = random.Random(seed)
        self.busy = False
        self.one_thread_speedup = one_thread_speedup  # below 1: a model too small to share
        self.now = self.waited = self.idle = 0.0
        self.report_load = report_load

    def seconds(self, threads: int, k: int) -> float:
        base = 0.001 * (1 + 0.2 * k)  # a longer k's round costs more, whatever the count
        taken = base * self.random.uniform(0.95, 1.05)
        if threads == 1:
            taken *= self.one_thread_speedup
            self.idle += 0 if self.busy else taken  # the other core has nothing to do
        elif self.busy and self.random.random() < 1 / 8:
            taken += 0.03
            self.waited += 0.03
        self.now += taken
        return taken

    def clock(self) -> float:
        return self.now

    def load(self) -> tuple[float, float] | None:
        return (self.waited, self.idle) if self.report_load else None

    def policy(self, pinned: int | None = None) -> ThreadPolicy:
        return ThreadPolicy(2, pinned=pinned, load=self.load, clock=self.clock)


def serve(policy: ThreadPolicy, machine: Machine, rounds: int, ks: tuple[int, ...] = (3,)) -> tuple[float, list[int]]:
    """Run `rounds` rounds (k drawn from `ks`, as a k policy's tries would mix them), returning the
    seconds they took and the thread count each ran on."""
    total, counts = 0.0, []
    for _ in range(rounds):
        k = machine.random.choice(ks)
        seconds = machine.seconds(policy.threads, k)
        counts.append(policy.threads)
        total += seconds
        policy.observe(k, 1, seconds)
    return total, counts


def best_fixed(machine: Machine, threads: int, rounds: int, ks: tuple[int, ...] = (3,)) -> float:
    return sum(machine.seconds(threads, machine.random.choice(ks)) for _ in range(rounds))


def test_the_counts_tried_are_every_core_then_halvings() -> None:
    assert counts_below(2) == [2, 1]
    assert counts_below(16) == [16, 8, 4, 2, 1]
    assert counts_below(1) == [1]


@pytest.mark.parametrize("ks", [(3,), (2, 3, 3, 3, 4)])
def test_on_idle_cores_every_core_serves_and_tries_cost_about_the_exploration_budget(ks) -> None:
    machine = Machine()
    policy = machine.policy()
    serve(policy, machine, 500, ks)  # the first try
    assert policy.serving == 2
    spent, counts = serve(policy, machine, 20_000, ks)
    fixed = best_fixed(machine, 2, 20_000, ks)
    assert spent <= 1.015 * fixed  # within 1% of always two threads, and the noise of 20,000 rounds
    assert counts.count(1) > 0  # it still looks now and then: the load may change
    assert policy.switches == 0


@pytest.mark.parametrize("report_load", [True, False], ids=["load known", "rounds alone"])
def test_a_busy_neighbour_moves_it_to_one_thread_within_a_few_hundred_rounds_and_back_when_it_goes(
    report_load: bool,
) -> None:
    machine = Machine(1, report_load)
    policy = machine.policy()
    serve(policy, machine, 2000)
    assert policy.serving == 2
    machine.busy = True
    _, counts = serve(policy, machine, 300)
    assert policy.serving == 1
    spent, counts = serve(policy, machine, 10_000)
    assert counts.count(1) > 0.97 * len(counts)
    # steady beside the neighbour: about one thread's speed, far ahead of two stalling threads
    assert spent <= 1.03 * best_fixed(machine, 1, 10_000) < 0.8 * best_fixed(machine, 2, 10_000)
    machine.busy = False
    _, counts = serve(policy, machine, MAX_SPACING + 500)
    assert policy.serving == 2 and counts[-400:].count(2) > 0.9 * 400


@pytest.mark.parametrize("report_load", [True, False], ids=["load known", "rounds alone"])
def test_an_engine_that_starts_beside_a_busy_neighbour_leaves_two_threads_at_once(report_load: bool) -> None:
    machine = Machine(2, report_load)
    policy = machine.policy()
    machine.busy = True
    _, counts = serve(policy, machine, 400)
    assert policy.serving == 1 and counts.count(2) < 120


def test_where_one_thread_is_faster_on_idle_cores_it_serves_one_and_the_idle_core_does_not_call_tries() -> None:
    machine = Machine(4, one_thread_speedup=0.8)
    policy = machine.policy()
    serve(policy, machine, 2000)
    assert policy.serving == 1
    spent, counts = serve(policy, machine, 20_000)
    assert spent <= 1.02 * best_fixed(machine, 1, 20_000)
    assert counts.count(2) < 0.02 * len(counts)


def test_a_pinned_count_is_never_left() -> None:
    machine = Machine(3)
    policy = machine.policy(pinned=2)
    machine.busy = True
    _, counts = serve(policy, machine, 3000)
    assert set(counts) == {2} and policy.switches == 0
    assert ThreadPolicy(4, pinned=1).threads == 1


def test_greedy_output_is_the_same_whatever_the_thread_count_of_each_round() -> None:
    """Every round on a count drawn anew, k drawn anew: the tokens are target-only decoding's."""
    target = load_checkpoint(DEFAULT_TARGET)
    draft = load_checkpoint(DEFAULT_DRAFT)
    prompts = [[5, 17, 90, 4, 61, 8], [300, 12, 12, 7], [42, 43, 44, 42, 43], [9, 1000, 9]]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        expected = [c.tokens for c in generate(target, prompts, params)]
        engine = Engine(target, HybridDrafter(draft, 4, 128, min_n=1, max_n=3), 4, 128, [0, 1, 3, 5])
        requests = [Request(tuple(p), params) for p in prompts]
        for request in requests:
            engine.add_request(request)
        outputs: dict[str, list[int]] = {r.id: [] for r in requests}
        chooser, seen = random.Random(7), set()
        while engine.has_work:
            threads = chooser.choice([1, 2])
            torch.set_num_threads(threads)
            seen.add(threads)
            for out in engine.step(chooser.choice([0, 1, 3, 5])).outputs:
                outputs[out.request_id].extend(out.new_tokens)
    finally:
        torch.set_num_threads(before)
    assert seen == {1, 2}
    assert [outputs[r.id] for r in requests] == expected
