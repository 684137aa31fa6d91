"""Adaptive step policies: the SGLang-compatible EMA ladder, the clock it shares, batch-size slots."""

from __future__ import annotations

from dataclasses import replace

import pytest

from control.schema import policy_params
from engine.policy import BatchSlot, EmaPolicy, Observation, SlottedPolicy, make_policy, snap

DEFAULTS = policy_params(strategy="ema")


def batch(k: int, accepted: list[int], draft_seconds: float = 0.0, verify_seconds: float = 0.0) -> Observation:
    return Observation(k, tuple(accepted), tuple([k] * len(accepted)), draft_seconds, verify_seconds)


def feed(policy, k_accepted: float, n: int, batch_size: int = 1):
    """Feed n batches whose mean accepted drafts is k_accepted; return the decisions made."""
    decisions = []
    for _ in range(n):
        whole = int(k_accepted)
        accepted = [whole] * batch_size
        if k_accepted != whole:  # a fractional mean: mix two values in one batch
            accepted = [whole, whole + 1]
        decision = policy.observe(batch(policy.k, accepted))
        if decision:
            decisions.append(decision)
    return decisions


def test_defaults_are_sglangs():
    assert DEFAULTS.candidate_k == (1, 3, 7)
    assert (DEFAULTS.ema_alpha, DEFAULTS.warmup_batches, DEFAULTS.update_interval) == (0.2, 10, 5)
    assert (DEFAULTS.up_hysteresis, DEFAULTS.down_hysteresis) == (0.0, -0.25)


@pytest.mark.parametrize(("initial", "expected"), [(0, 1), (1, 1), (2, 3), (4, 3), (5, 7), (6, 7), (9, 7), (None, 7)])
def test_initial_steps_snap_to_nearest_candidate_ties_to_larger(initial, expected):
    assert EmaPolicy(DEFAULTS, initial).k == expected
    assert snap(2, [1, 3]) == 3 and snap(5, [3, 7]) == 7


def test_ema_starts_at_k_minus_one():
    assert EmaPolicy(DEFAULTS, 3).ema == 2.0


@pytest.mark.parametrize("strategy", ["measured", "positional"])
def test_only_the_ema_strategy_reports_an_ema(strategy):
    slots = (BatchSlot(4, (0, 1)),)
    for params in (policy_params(strategy=strategy), policy_params(strategy=strategy, slots=slots)):
        policy = make_policy(params, 3)
        for _ in range(20):
            policy.observe(batch(policy.k, [policy.k, 0]))
        assert policy.ema is None
    assert make_policy(policy_params(strategy="ema", slots=slots), 3).ema == 2.0


def test_no_decision_during_warmup_then_one_every_interval():
    policy = EmaPolicy(DEFAULTS, 1)
    decided_at = []
    for i in range(1, 26):
        if policy.observe(batch(policy.k, [policy.k])):  # all drafts accepted: go up
            decided_at.append(i)
    assert decided_at[0] == 15  # warm-up 10, then every 5: first decision at batch 15
    assert all((i - 10) % 5 == 0 for i in decided_at)


def test_empty_batches_change_nothing_and_do_not_count_as_warmup():
    policy = EmaPolicy(DEFAULTS, 1)
    for _ in range(50):
        assert policy.observe(batch(1, [])) is None
    assert policy.ema == 0.0 and policy.k == 1
    decided_at = [i for i in range(1, 16) if policy.observe(batch(policy.k, [policy.k]))]
    assert decided_at == [15]  # the warm-up still ran its 10 rounds after the empty ones


def test_exact_tie_on_the_rise_threshold_does_not_move():
    params = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1)
    policy = EmaPolicy(params, 1)
    # ema == 0.5 exactly: 1 -> 3 needs ema > 0.5
    assert policy.observe(batch(1, [0, 1])) is None and policy.k == 1
    decision = policy.observe(batch(1, [1, 1]))
    assert decision.k == 3 and decision.reason == "up"  # 1.0 > 0.5: up to 3, but not past 2.5 to 7


def test_exact_tie_on_the_drop_threshold_moves():
    params = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1, candidate_k=(1, 3))
    policy = EmaPolicy(params, 3)
    # 3 -> 1 when ema <= 1 - 0.5 - 0.25 = 0.25; a batch mean of 0.25 is exactly on it.
    decision = policy.observe(Observation(3, (0, 0, 0, 1), (3, 3, 3, 3)))
    assert decision is not None and decision.k == 1 and decision.reason == "down"


def test_ladder_thresholds_with_defaults():
    params = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1)

    def after(initial: int, mean: float) -> int:
        policy = EmaPolicy(params, initial)
        policy.observe(Observation(initial, (int(mean * 4),) + (0,) * 3, (initial,) * 4))
        return policy.k

    # Observations are means of four requests: (x, 0, 0, 0) has mean x / 4.
    assert after(1, 0.5) == 1 and after(1, 0.75) == 3  # 1 -> 3 above 0.5
    assert after(3, 2.5) == 3 and after(3, 2.75) == 7  # 3 -> 7 above 2.5
    assert after(7, 2.25) == 3 and after(7, 2.5) == 7  # 7 -> 3 at or below 2.25
    assert after(3, 0.25) == 1 and after(3, 0.5) == 3  # 3 -> 1 at or below 0.25


def test_up_and_down_hysteresis_shift_the_thresholds():
    up = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1, up_hysteresis=0.5)
    policy = EmaPolicy(up, 1)
    policy.observe(batch(1, [1]))  # 1.0 is not > 0.5 + 0.5
    assert policy.k == 1
    down = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1, down_hysteresis=-1.0)
    policy = EmaPolicy(down, 7)
    policy.observe(Observation(7, (2, 2), (7, 7)))  # 2.0 > 3 - 0.5 - 1.0 = 1.5: stays
    assert policy.k == 7
    policy.observe(Observation(7, (1, 2), (7, 7)))  # 1.5 <= 1.5: drops
    assert policy.k == 3


def test_several_tiers_dropped_at_once():
    params = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1)
    policy = EmaPolicy(params, 7)
    decision = policy.observe(batch(7, [0]))
    assert decision.k == 1 and decision.reason == "down"


def test_ramp_up_then_down():
    policy = EmaPolicy(DEFAULTS, 1)
    seen = [policy.k]
    for _ in range(60):
        policy.observe(batch(policy.k, [policy.k]))  # every draft accepted
        seen.append(policy.k)
    assert seen[-1] == 7 and 3 in seen
    for _ in range(60):
        policy.observe(batch(policy.k, [0]))
        seen.append(policy.k)
    assert seen[-1] == 1
    firsts = [k for i, k in enumerate(seen) if i == 0 or seen[i - 1] != k]
    assert firsts == [1, 3, 7, 3, 1] or firsts == [1, 3, 7, 1]


def test_step_zero_is_left_for_a_probe_and_the_ema_is_frozen_there():
    params = replace(DEFAULTS, candidate_k=(0, 1, 3), ema_alpha=1.0, warmup_batches=0, update_interval=1)
    policy = EmaPolicy(params, 1)
    policy.observe(batch(1, [0]))  # 0 <= 0.5 - 0.25: speculation does not pay
    assert policy.k == 0
    ema = policy.ema
    decisions = feed(policy, 0, params.probe_interval - 1)
    assert decisions == [] and policy.ema == ema
    probe = policy.observe(batch(0, [0]))
    assert probe.k == 1 and probe.reason == "probe"


def test_new_alpha_keeps_the_ema_and_a_new_candidate_list_snaps_k():
    policy = EmaPolicy(DEFAULTS, 7)
    feed(policy, 5, 12)
    ema = policy.ema
    policy.update_params(replace(DEFAULTS, ema_alpha=0.5))
    assert policy.ema == ema and policy.k == 7
    policy.update_params(replace(DEFAULTS, candidate_k=(2, 4)))
    assert policy.k == 4 and policy.ema == ema


def test_invalid_params_are_refused_with_reasons():
    with pytest.raises(ValueError, match="candidate_k must not be empty"):
        policy_params(candidate_k=())
    with pytest.raises(ValueError, match="ema_alpha must be in"):
        policy_params(ema_alpha=0)
    with pytest.raises(ValueError, match="strategy must be"):
        policy_params(strategy="magic")


# ---- slots -----------------------------------------------------------------------------------


def test_batch_size_slots_keep_separate_candidates_and_state():
    params = policy_params(
        strategy="ema",
        candidate_k=(1, 3, 7),
        slots=(BatchSlot(1, (1, 3, 7)), BatchSlot(4, (0, 1))),
        warmup_batches=0,
        update_interval=1,
        ema_alpha=1.0,
    )
    policy = make_policy(params, 7)
    assert isinstance(policy, SlottedPolicy)
    assert policy.k == 7
    assert policy.candidates == [1, 3, 7]
    decision = policy.observe(Observation(7, (6, 6, 6, 6), (7, 7, 7, 7)))  # batch of 4: the second slot
    assert policy.k == 1 and decision is not None and decision.k == 1
    assert policy.candidates == [0, 1]  # what status shows as in force
    policy.observe(Observation(1, (6,), (7,)))  # back to batch 1: its own state, still at 7
    assert policy.k == 7 and policy.candidates == [1, 3, 7]
    assert params.all_k == (0, 1, 3, 7)
