"""The engine thread: one inbox from other threads, a status snapshot back; control while idle,
drain and stop."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from engine.controller import Controller
from engine.core import Engine
from engine.drafters.draft_model import DraftModelDrafter
from engine.generate import generate
from engine.loop import EngineLoop
from engine.request import Request
from engine.sampling import SamplingParams
from tests.test_controller import FAST
from tests.test_speculative import PROMPTS


@pytest.fixture
def loop(pair):
    target, draft = pair
    engine = Engine(target, DraftModelDrafter(draft, 2, 128), 2, 128, (1, 3, 7))
    loop = EngineLoop(Controller(engine, FAST), idle_wait=0.01)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    yield loop
    loop.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()


def collect(loop: EngineLoop, requests, also=lambda out: None) -> dict[str, list[int]]:
    """Submit `requests` and wait for them; `also` sees every output first, on the engine thread."""
    outputs: dict[str, list[int]] = {r.id: [] for r in requests}
    finished = threading.Semaphore(0)

    def on_output(out):
        also(out)
        outputs[out.request_id].extend(out.new_tokens)
        if out.finish_reason is not None:
            finished.release()

    for r in requests:
        loop.submit(r, on_output)
    for _ in requests:
        assert finished.acquire(timeout=30)
    return outputs


def test_requests_from_another_thread_are_served_losslessly(loop, pair):
    target, _ = pair
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    requests = [Request(tuple(p), params) for p in PROMPTS]  # 4 requests, 2 slots: they queue
    outputs = collect(loop, requests)
    assert [outputs[r.id] for r in requests] == [c.tokens for c in generate(target, PROMPTS, params)]
    assert loop.stats.tokens == 4 * 30 and loop.in_flight == 0
    # every verified sequence's round is counted by the k it drafted (adaspecctl status: sequence_rounds)
    assert sum(loop.stats.sequence_rounds.values()) == loop.stats.verified > 0


def test_control_is_applied_while_idle_and_published_in_the_status(loop):
    ack = loop.pin(3).result(timeout=5)
    assert ack.k == 3 and ack.mode == "pinned"
    assert loop.status.k == 3 and loop.status.mode == "pinned" and loop.status.pinned == 3
    with pytest.raises(ValueError, match="no runtime state for draft length 4"):
        loop.pin(4).result(timeout=5)
    assert loop.status.mode == "pinned" and loop.status.k == 3  # a rejected command changes nothing
    assert loop.unpin().result(timeout=5).mode == "adaptive"


def test_a_runtime_state_is_built_by_the_engine_thread_between_rounds(loop, pair):
    """While requests run, a build waits for the round in progress to end: no round is timed
    with a build beside it."""
    target, _ = pair
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    requests = [Request(tuple(p), params) for p in PROMPTS[:2]]
    builds = []  # (the build's future, whether it was done when sent from inside a round)

    def build_once(out):
        if not builds:  # called on the engine thread, inside a round's emit
            build = loop.build_state(4)
            builds.append((build, build.done()))

    outputs = collect(loop, requests, also=build_once)
    (build, done_when_sent), *_ = builds
    assert not done_when_sent and build.result(timeout=5).round > 0
    assert 4 in {s.k for s in loop.status.states}
    assert loop.set_params(replace(FAST, candidate_k=(1, 4))).result(timeout=5).k in (1, 4)
    assert [outputs[r.id] for r in requests] == [c.tokens for c in generate(target, PROMPTS[:2], params)]


def test_a_cancelled_request_ends_with_cancelled_and_leaves_the_count(loop):
    finished = threading.Event()
    reasons = []

    def on_output(out):
        if out.finish_reason is not None:
            reasons.append(out.finish_reason)
            finished.set()

    request = Request((1, 2, 3), SamplingParams(max_tokens=100, ignore_eos=True))
    loop.submit(request, on_output)
    loop.cancel(request.id).result(timeout=5)
    assert finished.wait(10) and reasons == ["cancelled"]
    assert loop.in_flight == 0


def test_drain_refuses_new_requests(loop):
    loop.drain()
    with pytest.raises(RuntimeError, match="draining"):
        loop.submit(Request((1, 2, 3), SamplingParams(max_tokens=4)), lambda out: None)


def test_a_bad_request_is_refused_and_leaves_no_trace(loop):
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        loop.submit(Request((1, 2, 3), SamplingParams(max_tokens=500)), lambda out: None)
    assert loop.in_flight == 0
