"""The engine thread: requests from other threads, control while idle, drain and stop."""

from __future__ import annotations

import threading

import pytest

from engine.controller import Controller
from engine.core import Engine
from engine.drafters import DraftModelDrafter
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


def collect(loop: EngineLoop, requests) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {r.id: [] for r in requests}
    finished = threading.Semaphore(0)

    def on_output(out):
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


def test_control_is_applied_while_idle(loop):
    ack = loop.controller.pin(3)
    loop.wake()
    assert ack.result(timeout=5).steps == 3
    assert loop.controller.mode_name == "pinned"


def test_drain_refuses_new_requests(loop):
    loop.drain()
    with pytest.raises(RuntimeError, match="draining"):
        loop.submit(Request((1, 2, 3), SamplingParams(max_tokens=4)), lambda out: None)


def test_a_bad_request_is_refused_and_leaves_no_trace(loop):
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        loop.submit(Request((1, 2, 3), SamplingParams(max_tokens=500)), lambda out: None)
    assert loop.in_flight == 0
