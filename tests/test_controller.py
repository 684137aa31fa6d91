"""The controller: pin, force, unpin and new parameters take effect between rounds only, and
output stays lossless through every switch."""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import replace

import pytest
from structlog.testing import capture_logs

from control.schema import policy_params
from engine.controller import Controller, Force, Pin, SetParams, Unpin
from engine.core import Engine
from engine.drafters.draft_model import DraftModelDrafter, HybridDrafter
from engine.drafters.ngram import NgramDrafter
from engine.generate import generate
from engine.policy import EmaPolicy, MeasuredPolicy, PositionalPolicy
from engine.request import Request, Sequence
from engine.sampling import SamplingParams
from tests.test_speculative import PROMPTS

FAST = policy_params(strategy="ema", warmup_batches=2, update_interval=1, ema_alpha=0.5)


def make(pair, params=FAST, steps=(0, 1, 2, 3, 5, 7), **kwargs) -> Controller:
    target, draft = pair
    engine = Engine(target, DraftModelDrafter(draft, 4, 128), 4, 128, steps)
    return Controller(engine, params, **kwargs)


def serve(controller: Controller, requests, on_step=None) -> dict[str, list[int]]:
    outputs = {r.id: [] for r in requests}
    for r in requests:
        controller.engine.add_request(r)
    while controller.engine.has_work:
        if on_step:
            on_step(controller)
        for out in controller.step().outputs:
            outputs[out.request_id].extend(out.new_tokens)
    return outputs


def test_adaptive_switches_happen_between_rounds_and_output_stays_lossless(pair):
    target, _ = pair
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    controller = make(pair)
    requests = [Request(tuple(p), params) for p in PROMPTS]
    ks = []
    levels = logging.getLogger("adaspec.engine")  # where the daemon's level reaches the engine
    levels.setLevel(logging.DEBUG)
    try:
        with capture_logs() as logs:
            outputs = serve(controller, requests, on_step=lambda c: ks.append(c.k))
    finally:
        levels.setLevel(logging.NOTSET)
    assert [outputs[r.id] for r in requests] == expected
    switches = [e for e in logs if e["event"] == "switch"]
    assert controller.switches == len(switches) > 0
    for event in switches:
        assert {"from", "to", "ema", "reason", "round"} <= set(event)
        # The round a switch is logged at runs with the new k; the one before with the old k.
        assert ks[event["round"]] == event["to"] and ks[event["round"] - 1] == event["from"]
        assert event["log_level"] == "debug"  # the policy's own: many a second, not for the journal

    # Above debug the policy's switches are counted, and no event is built for them.
    levels.setLevel(logging.INFO)
    try:
        with capture_logs() as logs:
            again = make(pair)
            serve(again, [Request(tuple(p), params) for p in PROMPTS])
    finally:
        levels.setLevel(logging.NOTSET)
    assert again.switches > 0 and not [e for e in logs if e["event"] == "switch"]


def test_an_operator_switch_is_logged_at_info(pair):
    controller = make(pair)
    controller.engine.add_request(Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=20, ignore_eos=True)))
    controller.step()
    with capture_logs() as logs:
        controller.apply(Pin(0 if controller.k else 1))
    [event] = [e for e in logs if e["event"] == "switch"]
    assert event["reason"] == "pin" and event["log_level"] == "info"
    assert isinstance(event["ema"], float)  # the ema strategy's


def test_a_switch_names_no_ema_where_the_policy_keeps_none(pair):
    controller = make(pair, policy_params(strategy="positional", candidate_k=(0, 2, 5)))  # starts at 2
    with capture_logs() as logs:
        controller.apply(Pin(5))
    [event] = [e for e in logs if e["event"] == "switch"]
    assert set(event) == {"event", "log_level", "from", "to", "reason", "round"}


def test_pin_holds_k_while_the_policy_keeps_observing_and_unpin_resumes(pair):
    controller = make(pair)
    engine = controller.engine
    for p in PROMPTS:
        engine.add_request(Request(tuple(p), SamplingParams(max_tokens=80, ignore_eos=True)))
    controller.step()
    ack = controller.apply(Pin(2))
    result = controller.step()
    assert ack.round == result.round and ack.k == 2 and ack.mode == "pinned"
    seen = []
    observe = controller.policy.observe
    controller.policy.observe = lambda observation: seen.append(observation) or observe(observation)
    for _ in range(8):
        assert controller.step().k == 2
    assert len(seen) == 8  # still observing
    assert controller.apply(Unpin()).mode == "adaptive"


def test_force_switches_at_the_next_boundary_then_adapts_again(pair):
    controller = make(pair)
    for p in PROMPTS:
        controller.engine.add_request(Request(tuple(p), SamplingParams(max_tokens=80, ignore_eos=True)))
    controller.step()
    ack = controller.apply(Force(5))
    result = controller.step()
    assert result.k == 5
    assert ack.mode == "forced" and ack.round == result.round
    assert controller.mode_name == "adaptive"


def test_a_pin_overrides_a_force_not_yet_run_and_unpin_adapts_from_the_pinned_k(pair):
    # On an idle daemon no round runs between an operator's commands.
    controller = make(pair)
    assert controller.apply(Force(1)).mode == "forced"
    assert controller.apply(Pin(3)).mode == "pinned"
    ack = controller.apply(Unpin())
    assert (ack.k, ack.mode) == (3, "adaptive")
    controller.engine.add_request(Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=20, ignore_eos=True)))
    assert controller.step().k == 3


def test_pin_to_a_k_without_runtime_state_is_refused_and_nothing_changes(pair):
    controller = make(pair, steps=(1, 3, 7))
    before = controller.k
    with pytest.raises(ValueError, match="no runtime state for draft length 4"):
        controller.apply(Pin(4))
    assert controller.k == before and controller.mode_name == "adaptive"


def test_new_params_apply_at_a_boundary_and_need_built_states(pair):
    controller = make(pair, steps=(1, 3, 7))
    controller.engine.add_request(Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=40, ignore_eos=True)))
    controller.step()
    with pytest.raises(ValueError, match="no runtime state for draft length 2"):
        controller.apply(SetParams(replace(FAST, candidate_k=(2, 4))))
    # Build the missing states between rounds, then the same parameters are accepted.
    for k in (2, 4):
        controller.engine.build_state(k)
    ok = controller.apply(SetParams(replace(FAST, candidate_k=(2, 4))))
    result = controller.step()
    assert ok.k in (2, 4) and result.k in (2, 4)


def test_static_mode_holds_its_k(pair):
    controller = make(pair, adaptive=False, static_k=3)
    for p in PROMPTS:
        controller.engine.add_request(Request(tuple(p), SamplingParams(max_tokens=30, ignore_eos=True)))
    ks = {controller.step().k for _ in range(10)}
    assert ks == {3} and controller.mode_name == "static"
    with pytest.raises(ValueError, match="adaptation is disabled"):
        controller.apply(Force(1))
    # A pin holds over the static k, and over a reload that changes it, until unpinned.
    assert (controller.apply(Pin(5)).k, controller.step().k) == (5, 5)
    ack = controller.apply(SetParams(FAST, adaptive=False, static_k=1))
    assert (ack.k, ack.mode, controller.step().k) == (5, "pinned", 5)
    assert (controller.apply(Unpin()).k, controller.step().k) == (1, 1)


def test_the_policy_sees_each_round_whole_from_drafting_to_emitting(pair):
    """Its throughput counts the round's whole time, not only the draft and verify forwards;
    admitting a new request is no part of a round."""
    controller = make(pair, replace(FAST, strategy="measured"))
    seen = []
    observe = controller.policy.observe
    controller.policy.observe = lambda observation: seen.append(observation) or observe(observation)
    serve(controller, [Request(tuple(p), SamplingParams(max_tokens=20, ignore_eos=True)) for p in PROMPTS])
    assert seen
    for observation in seen:
        assert observation.round_seconds > observation.draft_seconds + observation.verify_seconds > 0


def test_the_positional_strategy_tries_single_rounds_and_output_stays_lossless(pair):
    target, _ = pair
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    policy = replace(FAST, strategy="positional", candidate_k=(0, 1, 2, 3, 5, 7), probe_interval=2)
    controller = make(pair, policy)
    requests = [Request(tuple(p), params) for p in PROMPTS]
    ks: list[int] = []
    outputs = serve(controller, requests, on_step=lambda c: ks.append(c.k))
    assert [outputs[r.id] for r in requests] == expected
    assert len(set(ks)) >= 3 and controller.switches > 0
    # A try is a round at another k (two from k = 0, where the drafter first catches up), and
    # the policy returns to the k it serves.
    runs = [(k, len(list(group))) for k, group in itertools.groupby(ks)]
    assert any(a == c != b and n <= 2 for (a, _), (b, n), (c, _) in zip(runs, runs[1:], runs[2:]))


def test_timing_every_state_before_serving_leaves_the_engine_as_it_found_it(pair):
    target, draft = pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    drafter = HybridDrafter(draft, 4, 128, min_n=1, max_n=3, history=4096)
    engine = Engine(target, drafter, 4, 128, (0, 2, 5))
    engine.run_until_done([Request(tuple(PROMPTS[0]), params)])
    history, rounds = dict(drafter.lookups.history.texts), engine.round
    stats = {k: (s.stats.rounds, s.stats.tokens) for k, s in engine.states.items()}

    profile = engine.time_rounds([1, 3], rounds=4)

    assert set(profile) == {(k, b) for k in (0, 2, 5) for b in (1, 3)}
    assert all(seconds > 0 for seconds in profile.values())
    assert profile[5, 3] > profile[0, 1]  # five drafts for three sequences cost more than none for one
    assert engine.round == rounds and not engine.has_work
    assert {k: (s.stats.rounds, s.stats.tokens) for k, s in engine.states.items()} == stats
    assert drafter.lookups.history.texts == history and drafter.lookups.enabled
    assert engine.states[5].round_seconds == {1: profile[5, 1], 3: profile[5, 3]}
    controller = Controller(engine, policy_params(strategy="positional", candidate_k=(0, 2, 5)))
    # The policy prices every k that drafts by it from the start (k = 0 by its own rounds).
    assert controller.policy.profile == {(k, b): seconds for (k, b), seconds in profile.items() if k > 0}
    requests = [Request(tuple(p), params) for p in PROMPTS]
    outputs = engine.run_until_done(requests)
    assert [outputs[r.id] for r in requests] == expected


def test_timing_needs_an_idle_engine(pair):
    target, draft = pair
    engine = Engine(target, DraftModelDrafter(draft, 4, 128), 4, 128, (0, 2))
    engine.add_request(Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=8)))
    with pytest.raises(RuntimeError, match="idle"):
        engine.time_rounds([1])


def test_a_reload_to_another_strategy_starts_it_from_the_current_k(pair):
    controller = make(pair, replace(FAST, strategy="positional", candidate_k=(0, 2, 5)), initial_k=5)
    assert isinstance(controller.policy, PositionalPolicy)
    controller.apply(SetParams(replace(FAST, strategy="ema", candidate_k=(1, 3, 7))))
    assert isinstance(controller.policy, EmaPolicy) and controller.k == 7  # 5 snapped onto the ladder
    controller.apply(SetParams(replace(FAST, strategy="measured", candidate_k=(0, 2, 5))))
    assert isinstance(controller.policy, MeasuredPolicy) and controller.k == 5


def test_timing_fits_any_vocabulary_and_a_short_max_seq_len(tiny_vocab_pair):
    target, draft = tiny_vocab_pair  # 8 tokens; 16 positions: timed sequences end early
    engine = Engine(target, DraftModelDrafter(draft, 2, 16), 2, 16, (0, 1, 3))
    profile = engine.time_rounds([1, 2])
    assert set(profile) == {(k, b) for k in (0, 1, 3) for b in (1, 2)}
    assert not engine.has_work and engine.round == 0


def test_the_ngram_drafter_is_timed_at_every_k_s_full_width_and_then_drafts_as_before(pair):
    """Lookups may find little in the timed text: each timed round still verifies its full k, so
    a long k is not priced at the cost of a short one; serving afterwards proposes lookups alone."""
    target, _ = pair
    drafter = NgramDrafter(1, 3, history=4096)
    engine = Engine(target, drafter, 2, 128, (0, 2, 5))
    unmatched = Request((1, 2, 3, 4, 5), SamplingParams(max_tokens=8))  # no n-gram of it repeats
    seq = Sequence(request=unmatched, slot=0, generator=None, tokens=list(unmatched.prompt))
    drafter.admit([seq])
    assert drafter.propose([seq], [5])[0].tokens == []
    with drafter.timing():
        assert len(drafter.propose([seq], [5])[0].tokens) == 5
        assert drafter.history is None
    drafter.release(seq)

    widths: dict[int, set[int]] = {}
    verify = engine.verify

    def recording(seqs, proposals, state=None):
        full = [len(p.tokens) for p, s in zip(proposals, seqs) if s.remaining > state.k]
        widths.setdefault(state.k, set()).update(full)
        return verify(seqs, proposals, state)

    engine.verify = recording
    engine.time_rounds([1, 2], rounds=3)
    assert widths == {0: {0}, 2: {2}, 5: {5}}
    assert not drafter.full_width and drafter.history is not None
    widths.clear()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    requests = [Request(tuple(p), params) for p in PROMPTS[:2]]
    outputs = engine.run_until_done(requests, 5)
    assert [outputs[r.id] for r in requests] == [c.tokens for c in generate(target, PROMPTS[:2], params)]


def test_each_row_drafts_the_k_the_policy_plans_for_it_losslessly_and_a_pin_sets_one_k_for_all(pair):
    target, _ = pair
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    policy = replace(FAST, strategy="positional", candidate_k=(0, 1, 2, 3, 5, 7), per_sequence=True)
    controller = make(pair, policy, steps=(0, 1, 2, 3, 5, 7))
    chooser, plans = random.Random(2), {}

    def plan(ids):  # what the policy would plan, drawn at random: rows of 0 to 4 drafts
        plans.update({i: chooser.randint(0, 4) for i in ids})
        return {i: plans[i] for i in ids}

    controller.policy.row_ks = plan
    requests = [Request(tuple(p), params) for p in PROMPTS]
    rounds = []
    controller.engine.step = spy(controller.engine.step, rounds)
    outputs = serve(controller, requests)
    assert [outputs[r.id] for r in requests] == expected
    for k, row_ks, result in rounds:
        if row_ks:
            # The round runs the least state that holds every row's k (4 is not built: 5)
            assert k == min(s for s in (0, 1, 2, 3, 5, 7) if s >= max(row_ks.values()))
            for out in result.outputs:
                if out.verified:
                    assert out.drafts_proposed <= row_ks.get(out.request_id, k)
    assert any(len({o.drafts_proposed for o in r.outputs if o.verified}) > 2 for _, _, r in rounds)
    assert {o.drafts_proposed for _, _, r in rounds for o in r.outputs if o.verified} >= {0, 1, 2, 3, 4}
    # Pinned, every row drafts the pinned k (or what its max_tokens leaves it).
    controller.apply(Pin(3))
    more = [Request(tuple(p), params) for p in PROMPTS]
    rounds.clear()
    outputs = serve(controller, more)
    assert [outputs[r.id] for r in more] == expected
    assert all(k == 3 and row_ks is None for k, row_ks, _ in rounds)


def spy(step, rounds: list):
    """engine.step, recording each round's k, row plan and result."""

    def recorded(k, rule, row_ks=None):
        result = step(k, rule, row_ks)
        rounds.append((k, row_ks, result))
        return result

    return recorded
