"""Adaptive step policies: SGLang-compatible EMA ladder, cost-aware goodput, batch-size slots."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from dataclasses import replace

import pytest

from engine.drafters import Proposal
from engine.policy import (
    STALL_FACTOR,
    BatchSlot,
    Calibration,
    CostModel,
    DraftRecord,
    EmaPolicy,
    GoodputPolicy,
    LookupCalibration,
    Observation,
    PolicyParams,
    SlottedPolicy,
    VerifyCurve,
    make_policy,
    snap,
)

DEFAULTS = PolicyParams()


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
        decision = policy.observe(batch(policy.steps, accepted))
        if decision:
            decisions.append(decision)
    return decisions


def test_defaults_are_sglangs():
    assert DEFAULTS.candidate_steps == (1, 3, 7)
    assert (DEFAULTS.ema_alpha, DEFAULTS.warmup_batches, DEFAULTS.update_interval) == (0.2, 10, 5)
    assert (DEFAULTS.up_hysteresis, DEFAULTS.down_hysteresis) == (0.0, -0.25)


@pytest.mark.parametrize(("initial", "expected"), [(0, 1), (1, 1), (2, 3), (4, 3), (5, 7), (6, 7), (9, 7), (None, 7)])
def test_initial_steps_snap_to_nearest_candidate_ties_to_larger(initial, expected):
    assert EmaPolicy(DEFAULTS, initial).steps == expected
    assert snap(2, [1, 3]) == 3 and snap(5, [3, 7]) == 7


def test_ema_starts_at_steps_minus_one():
    assert EmaPolicy(DEFAULTS, 3).ema == 2.0


def test_no_decision_during_warmup_then_one_every_interval():
    policy = EmaPolicy(DEFAULTS, 1)
    decided_at = []
    for i in range(1, 26):
        if policy.observe(batch(policy.steps, [policy.steps])):  # all drafts accepted: go up
            decided_at.append(i)
    assert decided_at[0] == 15  # warm-up 10, then every 5: first decision at batch 15
    assert all((i - 10) % 5 == 0 for i in decided_at)


def test_empty_batches_change_nothing_and_do_not_count_as_warmup():
    policy = EmaPolicy(DEFAULTS, 3)
    for _ in range(50):
        assert policy.observe(batch(3, [])) is None
    assert policy.ema == 2.0 and policy.batches == 0


def test_exact_tie_on_the_rise_threshold_does_not_move():
    params = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1)
    policy = EmaPolicy(params, 1)
    # ema == 0.5 exactly: 1 -> 3 needs ema > 0.5
    assert policy.observe(batch(1, [0, 1])) is None and policy.steps == 1
    decision = policy.observe(batch(1, [1, 1]))
    assert decision.steps == 3 and decision.reason == "up"  # 1.0 > 0.5: up to 3, but not past 2.5 to 7


def test_exact_tie_on_the_drop_threshold_moves():
    params = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1, candidate_steps=(1, 3))
    policy = EmaPolicy(params, 3)
    # 3 -> 1 when ema <= 1 - 0.5 - 0.25 = 0.25; a batch mean of 0.25 is exactly on it.
    decision = policy.observe(Observation(3, (0, 0, 0, 1), (3, 3, 3, 3)))
    assert decision is not None and decision.steps == 1 and decision.reason == "down"


def test_ladder_thresholds_with_defaults():
    params = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1)

    def after(initial: int, mean: float) -> int:
        policy = EmaPolicy(params, initial)
        policy.observe(Observation(initial, (int(mean * 4),) + (0,) * 3, (initial,) * 4))
        return policy.steps

    # Observations are means of four requests: (x, 0, 0, 0) has mean x / 4.
    assert after(1, 0.5) == 1 and after(1, 0.75) == 3  # 1 -> 3 above 0.5
    assert after(3, 2.5) == 3 and after(3, 2.75) == 7  # 3 -> 7 above 2.5
    assert after(7, 2.25) == 3 and after(7, 2.5) == 7  # 7 -> 3 at or below 2.25
    assert after(3, 0.25) == 1 and after(3, 0.5) == 3  # 3 -> 1 at or below 0.25


def test_up_and_down_hysteresis_shift_the_thresholds():
    up = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1, up_hysteresis=0.5)
    policy = EmaPolicy(up, 1)
    policy.observe(batch(1, [1]))  # 1.0 is not > 0.5 + 0.5
    assert policy.steps == 1
    down = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1, down_hysteresis=-1.0)
    policy = EmaPolicy(down, 7)
    policy.observe(Observation(7, (2, 2), (7, 7)))  # 2.0 > 3 - 0.5 - 1.0 = 1.5: stays
    assert policy.steps == 7
    policy.observe(Observation(7, (1, 2), (7, 7)))  # 1.5 <= 1.5: drops
    assert policy.steps == 3


def test_several_tiers_dropped_at_once():
    params = replace(DEFAULTS, ema_alpha=1.0, warmup_batches=0, update_interval=1)
    policy = EmaPolicy(params, 7)
    decision = policy.observe(batch(7, [0]))
    assert decision.steps == 1 and decision.reason == "down"


def test_ramp_up_then_down():
    policy = EmaPolicy(DEFAULTS, 1)
    seen = [policy.steps]
    for _ in range(60):
        policy.observe(batch(policy.steps, [policy.steps]))  # every draft accepted
        seen.append(policy.steps)
    assert seen[-1] == 7 and 3 in seen
    for _ in range(60):
        policy.observe(batch(policy.steps, [0]))
        seen.append(policy.steps)
    assert seen[-1] == 1
    firsts = [k for i, k in enumerate(seen) if i == 0 or seen[i - 1] != k]
    assert firsts == [1, 3, 7, 3, 1] or firsts == [1, 3, 7, 1]


def test_step_zero_is_left_for_a_probe_and_the_ema_is_frozen_there():
    params = replace(DEFAULTS, candidate_steps=(0, 1, 3), ema_alpha=1.0, warmup_batches=0, update_interval=1)
    policy = EmaPolicy(params, 1)
    policy.observe(batch(1, [0]))  # 0 <= 0.5 - 0.25: speculation does not pay
    assert policy.steps == 0
    ema = policy.ema
    decisions = feed(policy, 0, params.probe_interval - 1)
    assert decisions == [] and policy.ema == ema
    probe = policy.observe(batch(0, [0]))
    assert probe.steps == 1 and probe.reason == "probe"


def test_new_alpha_keeps_the_ema_and_a_new_candidate_list_snaps_k():
    policy = EmaPolicy(DEFAULTS, 7)
    feed(policy, 5, 12)
    ema = policy.ema
    policy.update_params(replace(DEFAULTS, ema_alpha=0.5))
    assert policy.ema == ema and policy.steps == 7
    policy.update_params(replace(DEFAULTS, candidate_steps=(2, 4)))
    assert policy.steps == 4 and policy.ema == ema


def test_invalid_params_are_refused_with_reasons():
    with pytest.raises(ValueError, match="candidate_steps must not be empty"):
        PolicyParams(candidate_steps=())
    with pytest.raises(ValueError, match="ema_alpha must be in"):
        PolicyParams(ema_alpha=0)
    with pytest.raises(ValueError, match="strategy must be"):
        PolicyParams(strategy="magic")


# ---- goodput ------------------------------------------------------------------------------


def cost(k: int, verify: float = 0.010, per_step: float = 0.002) -> tuple[float, float]:
    return k * per_step, verify + 0.0005 * k


def goodput_feed(policy: GoodputPolicy, acceptance: float, rounds: int, batch_size: int = 1, **cost_kwargs):
    """Rounds where each draft position survives with probability `acceptance` (deterministic
    counts: the accepted length per request follows the geometric expectation)."""
    decisions = []
    for _ in range(rounds):
        k = policy.steps
        draft_s, verify_s = cost(k, **cost_kwargs)
        accepted = []
        for i in range(batch_size * 10):
            run = 0
            while run < k and ((i * 7919) % 1000) / 1000 < acceptance ** (run + 1):
                run += 1
            accepted.append(run)
        decision = policy.observe(Observation(k, tuple(accepted), (k,) * len(accepted), draft_s, verify_s))
        if decision:
            decisions.append(decision)
    return decisions


# Without the cutoff, goodput chooses among every candidate k; with it, only between k = 0 and the
# ceiling (tested further down).
FULL_CHAINS = PolicyParams(strategy="goodput", candidate_steps=(0, 1, 3, 5, 7), draft_cutoff=False)


def test_goodput_climbs_to_a_long_chain_when_drafts_are_good_and_cheap():
    params = FULL_CHAINS
    policy = GoodputPolicy(params, 1)
    goodput_feed(policy, 0.95, 120)
    assert policy.steps == 7


def test_goodput_settles_on_a_short_chain_when_acceptance_is_middling():
    params = FULL_CHAINS
    policy = GoodputPolicy(params, 7)
    goodput_feed(policy, 0.5, 120, per_step=0.004)
    assert policy.steps in (1, 3)


def test_goodput_turns_speculation_off_when_drafts_are_hopeless_and_probes_back():
    params = replace(FULL_CHAINS, candidate_steps=(0, 1, 3), probe_interval=20)
    policy = GoodputPolicy(params, 3)
    decisions = goodput_feed(policy, 0.0, 60)
    assert policy.steps == 0 or any(d.reason == "probe" for d in decisions)
    assert any(d.steps == 0 for d in decisions)
    reasons = [d.reason for d in goodput_feed(policy, 0.0, 60)]
    assert "probe" in reasons  # it keeps checking whether the drafts became useful


def test_goodput_does_not_flap_between_near_equal_choices():
    params = replace(FULL_CHAINS, candidate_steps=(3, 4), switch_margin=0.10)
    policy = GoodputPolicy(params, 3)
    decisions = goodput_feed(policy, 0.7, 200, per_step=0.003)
    assert len(decisions) <= 2


def test_one_unlucky_first_round_does_not_turn_drafting_off_at_the_end_of_the_warm_up():
    """Until a depth has seen enough rounds its rate is their mean: the first round, with nothing
    kept, counts as one of ten, not as where the rate starts and leaves 5% a round."""
    policy = GoodputPolicy(replace(FULL_CHAINS, candidate_steps=(0, 3)), 3)
    decisions = []
    for kept in [0] + [3] * 14:
        draft_s, verify_s = cost(3, per_step=0.004)  # drafting pays at 0.9 a draft, not at 0.5
        decisions.append(policy.observe(Observation(3, (kept,), (3,), draft_s, verify_s)))
    assert policy.acceptance.rates[0] == pytest.approx(14 / 15, abs=0.01)
    assert [d for d in decisions if d is not None and d.steps == 0] == []
    assert policy.steps == 3


def test_goodput_expected_tokens_from_position_rates():
    policy = GoodputPolicy(PolicyParams(strategy="goodput"), 3)
    policy.acceptance.rates = [0.8, 0.5]
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.4)
    assert policy.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)  # deeper reuses the last rate


# ---- cutting a round's drafting short ---------------------------------------------------------


def test_calibration_learns_how_often_each_confidence_is_kept_from_judged_drafts_only():
    calibration = Calibration()
    assert calibration.probability(0.95, recent=0.95) == pytest.approx(0.95)  # trusts the history at first
    for _ in range(300):
        # Confident first drafts are always kept; the doubtful second one never is; the third
        # was never judged (the second was rejected), so it must not count against 0.95.
        calibration.learn([0.95, 0.35, 0.95], accepted=1, recent=0.95)
    assert calibration.probability(0.95, recent=0.95) > 0.99
    assert calibration.probability(0.35, recent=0.95) < 0.01
    assert calibration.probability(0.05, recent=0.95) == pytest.approx(0.95)  # no evidence, no change
    assert calibration.probability(0.35, recent=0.3) == pytest.approx(0.25)  # another history: its own cell


def chain(*confidence: float, sampled: bool = False, recent: float = 0.95) -> Proposal:
    """A sequence's drafts so far; by default it lately kept most of its drafts."""
    return Proposal([0] * len(confidence), confidence=list(confidence), sampled=sampled, acceptance=recent)


def observe_round(
    policy: GoodputPolicy,
    accepted: tuple[int, ...],
    confidence: tuple[tuple[float, ...], ...],
    draft_seconds: float = 0.0005,
    per_row: float = 0.0001,
    verify_seconds: float = 0.010,
    per_token: float = 0.0002,
    sampled: tuple[bool, ...] = (),
    acceptance: tuple[float, ...] = (),
) -> None:
    """One round at k = 7 that drafted `confidence` (a chain per sequence), priced as the engine
    runs it on a CPU: each draft step costs `draft_seconds` plus `per_row` for each chain drafted
    in it, and the verify forward `per_token` for each token it checks (drafts, and the token
    before each chain)."""
    proposed = tuple(len(c) for c in confidence)
    steps = max(proposed)
    drafting = steps * draft_seconds + sum(proposed) * per_row
    verify = verify_seconds + per_token * (sum(proposed) + len(proposed))
    sampled = sampled or (False,) * len(confidence)
    acceptance = acceptance or (0.95,) * len(confidence)
    chains = tuple(DraftRecord(c, s, a) for c, s, a in zip(confidence, sampled, acceptance))
    policy.observe(Observation(7, accepted, proposed, drafting, verify, chains))


def cutoff_policy(draft_seconds: float) -> GoodputPolicy:
    """A goodput policy at k = 7 that has measured rounds of 4 and 7 drafts at batch 2, where the
    second chain's drafts after the fourth (confidence 0.2) are always rejected."""
    policy = GoodputPolicy(PolicyParams(strategy="goodput", candidate_steps=(7,), draft_cutoff=True), 7)
    for i in range(30):
        n = 7 if i % 2 else 4
        short = 4 if i % 3 == 0 else n
        confidence = ((0.95,) * n, ((0.95,) * 4 + (0.2,) * (n - 4))[:short])
        observe_round(policy, (n, 4), confidence, draft_seconds)
    return policy


def test_cutoff_drafts_on_while_confident_and_stops_when_the_chain_is_doubtful():
    policy = cutoff_policy(draft_seconds=0.0005)
    keep = policy.draft_cutoff()
    assert keep is not None
    assert keep([chain(0.95, 0.95, 0.95)]) == [True]  # the chain very likely survives: worth another step
    assert keep([chain(0.95, 0.2, 0.2)]) == [False]  # it almost surely broke already


def test_cutoff_weighs_the_cost_of_a_draft_step():
    cheap, dear = cutoff_policy(draft_seconds=0.0002), cutoff_policy(draft_seconds=0.004)
    survive_half_the_time = [chain(0.95, 0.95, recent=0.8)] * 2  # 0.8 * 0.825 * 0.825 each
    assert cheap.keep_drafting(survive_half_the_time) == [True, True]
    assert dear.keep_drafting(survive_half_the_time) == [False, False]


def test_cutoff_lets_the_likely_chains_go_on_without_the_hopeless_ones():
    """Each chain that goes on adds its own token to the verify forward: a chain whose next draft
    is unlikely to be kept stops while a confident one in the same round drafts on."""
    policy = cutoff_policy(draft_seconds=0.0005)
    confident, hopeless = chain(0.95, 0.95, 0.95), chain(0.95, 0.95, 0.95, 0.95, recent=0.6)
    assert policy.keep_drafting([confident, hopeless]) == [True, False]
    assert policy.keep_drafting([hopeless, confident]) == [False, True]
    assert policy.keep_drafting([hopeless, hopeless]) == [False, False]


def test_a_slow_sequence_drafts_on_where_a_fast_one_stops():
    """A sequence holds its batch slot until its output is done, so a token gained by one that
    emits 1.5 a round frees its slot eight times sooner than one gained by a sequence that emits
    12. Two chains alike but for their pace: the slow one drafts on, the fast one stops. A chain
    at the batch's own pace is priced as the batch's throughput prices it."""
    policy = cutoff_policy(draft_seconds=0.0005)

    def doubtful(pace: float | None) -> Proposal:
        return Proposal([0, 0], confidence=[0.95, 0.95], acceptance=0.6, pace=pace)

    assert policy.keep_drafting([doubtful(1.5), doubtful(12.0)]) == [True, False]
    assert policy.keep_drafting([doubtful(12.0), doubtful(1.5)]) == [False, True]
    assert policy.keep_drafting([doubtful(None)]) == [False]
    tokens, seconds, rounds = policy.served[2]
    batch_pace = tokens / rounds / 2
    assert policy.token_worth(doubtful(batch_pace)) == pytest.approx(policy.token_worth(doubtful(None)))
    assert policy.keep_drafting([doubtful(batch_pace)]) == [False]


def test_chains_share_the_price_of_a_draft_step():
    """A draft step costs about the same for one row as for two: a chain that does not pay for a
    step on its own goes on when another as likely shares it."""
    policy = cutoff_policy(draft_seconds=0.0005)
    likely_enough = chain(0.95, 0.95, recent=0.8)
    assert policy.keep_drafting([likely_enough]) == [False]
    assert policy.keep_drafting([likely_enough, likely_enough]) == [True, True]


def test_verify_tokens_are_priced_alike_at_any_batch_size():
    """The verify cost is fitted against the tokens it checks, not a padded width: rounds whose
    chains differ in length teach the same price of a token at batch 2 as at batch 1."""
    alone, paired = (GoodputPolicy(PolicyParams(strategy="goodput", candidate_steps=(7,)), 7) for _ in range(2))
    for i in range(30):
        n = 7 if i % 2 else 4
        observe_round(alone, (n,), ((0.95,) * n,), per_token=0.0008)
        observe_round(paired, (n, n), ((0.95,) * n, (0.95,) * (1 + i % 2)), per_token=0.0008)
    assert alone.costs.verify_fit.slope() == pytest.approx(0.0008, rel=0.01)
    assert paired.costs.verify_fit.slope() == pytest.approx(0.0008, rel=0.01)


def test_the_next_draft_is_weighed_by_what_recent_acceptance_predicts():
    """Sampled drafts kept at random, 70% whatever the sequence kept lately: a sequence that
    lately kept few is as likely to keep its next draft as one that kept many."""
    calibration = Calibration()
    rng = random.Random(0)
    for _ in range(3000):
        recent = rng.random()
        accepted = 0
        while accepted < 4 and rng.random() < 0.7:
            accepted += 1
        calibration.learn((0.05,) * 4, accepted, recent)
    assert calibration.next_draft(0.3) == pytest.approx(0.7, abs=0.1)
    assert calibration.next_draft(0.95) == pytest.approx(0.7, abs=0.1)


def test_cutoff_calibrates_sampled_drafts_apart_from_greedy_ones():
    """At temperature 1 a flat draft distribution (low q) that matches a flat target is kept as
    often as a confident one; greedy drafts at the same confidence are mostly rejected."""
    policy = cutoff_policy(draft_seconds=0.0005)
    for i in range(300):
        n = 7 if i % 2 else 4
        greedy = 1 if i % 3 == 0 else n
        flat = ((0.05,) * greedy, (0.05,) * n)
        observe_round(policy, (0, min(5, n)), flat, sampled=(False, True))
    assert policy.calibration[False].probability(0.05, recent=0.95) < 0.1
    assert policy.calibration[True].probability(0.05, recent=0.95) > 0.65
    assert policy.keep_drafting([chain(0.05, 0.05)] * 2) == [False, False]
    assert policy.keep_drafting([chain(0.05, 0.05, sampled=True)] * 2) == [True, True]


def test_cutoff_trusts_a_sequence_that_keeps_its_drafts_even_where_the_drafter_sounds_unsure():
    """A sequence repeating a pattern keeps every draft although the drafter's top probability is
    0.3; another at the same confidence keeps few. Each is judged by what its kind of sequence does."""
    policy = cutoff_policy(draft_seconds=0.0005)
    for i in range(200):
        n = 7 if i % 2 else 4
        doubted = 1 if i % 3 == 0 else n
        unsure = ((0.3,) * n, (0.3,) * doubted)
        observe_round(policy, (n, 0), unsure, acceptance=(0.97, 0.4))
    assert policy.keep_drafting([chain(0.3, 0.3, 0.3, recent=0.97)] * 2) == [True, True]
    assert policy.keep_drafting([chain(0.3, 0.3, 0.3, recent=0.4)] * 2) == [False, False]


def test_position_rates_hold_steady_at_batch_1():
    """A round at batch 1 shows one kept-or-not per depth: the rates must average over many rounds,
    or a run of rejections would stop chains (and choose k = 0) at random."""
    policy = GoodputPolicy(PolicyParams(strategy="goodput", candidate_steps=(3,)), 3)
    draws = random.Random(0)
    seen = []
    for _ in range(600):
        kept = 0
        while kept < 3 and draws.random() < 0.7:
            kept += 1
        policy.observe(Observation(3, (kept,), (3,), 0.002, 0.006, (DraftRecord((0.5,) * 3),)))
        seen.append(policy.acceptance.rates[0])
    settled = seen[200:]
    mean = sum(settled) / len(settled)
    spread = (sum((r - mean) ** 2 for r in settled) / len(settled)) ** 0.5
    assert mean == pytest.approx(0.7, abs=0.05)
    assert spread < 0.1  # at the ema strategy's alpha (0.2) it was 0.15


def test_throughput_is_the_tokens_of_whole_rounds_over_their_time():
    """The price of a draft step is what the rounds serve per second: the whole round's time
    (emitting too, not only drafting and verifying), and tokens over seconds, not a mean of
    per-round rates (which would weigh a short round as much as a long one)."""
    policy = GoodputPolicy(PolicyParams(strategy="goodput", candidate_steps=(7,)), 7)
    for i in range(200):
        accepted, seconds = ((0,), 0.010) if i % 2 else ((7,), 0.020)
        policy.observe(Observation(7, accepted, (7,), 0.002, 0.006, (DraftRecord((0.5,) * 7),), round_seconds=seconds))
    assert policy.throughput(1) == pytest.approx(9 / 0.030, rel=0.02)  # not (100 + 400) / 2
    assert policy.throughput(2) is None


def test_cutoff_prices_a_draft_step_at_its_marginal_cost():
    """The first draft step also feeds the tokens verification kept: it costs more than the next
    ones, and the cutoff must weigh the next step, not the average."""
    policy = GoodputPolicy(PolicyParams(strategy="goodput", candidate_steps=(7,)), 7)
    for round_ in range(60):
        steps = 1 + round_ % 7
        policy.observe(
            Observation(7, (steps,), (steps,), 0.003 + 0.0005 * steps, 0.010, (DraftRecord((0.9,) * steps),))
        )
    assert policy.costs.draft_step_seconds(1) == pytest.approx(0.0005, rel=0.01)
    assert policy.costs.round_seconds(7, 1) == pytest.approx(0.0065 + 0.010, rel=0.05)


def test_a_round_without_drafts_is_not_priced_below_the_fewest_tokens_recently_verified():
    """Long looked-up chains fit the verify's cost where it grows with every token: that line,
    carried down to one token a row, priced a round without drafts at a third of what it costs,
    and goodput switched to k = 0 in repetitive text. Below the fewest tokens recent rounds
    verified, a round is priced as those were; a round of fewer tokens lowers that at once."""
    costs = CostModel()
    for round_ in range(100):
        width = 8 + round_ % 9  # chains of 7 to 15 drafts at batch 4: 32 to 64 tokens verified
        chains = (DraftRecord((1.0,) * width, looked_up=True, match=4),) * 4
        costs.record(Observation(16, (width,) * 4, (width,) * 4, 0.0, 0.002 + 0.0002 * 4 * (width + 1), chains))
    assert costs.verify_fit.predict(4) == pytest.approx(0.0028, rel=0.01)  # the line itself
    # Priced as the narrowest recent rounds were (32 tokens, the floor drifting up a little
    # between them), not at the line's 2.8 ms.
    assert 0.002 + 0.0002 * 32 <= costs.round_seconds(0, 4) <= 0.002 + 0.0002 * 40
    for _ in range(3):
        costs.record(Observation(0, (0,) * 4, (0,) * 4, 0.0, 0.005, ()))
    assert costs.round_seconds(0, 4) == pytest.approx(0.005, rel=0.01)  # measured: the round itself
    assert costs.verify_fit.low == 4


def test_goodput_with_the_cutoff_chooses_between_no_drafting_and_the_ceiling():
    params = PolicyParams(strategy="goodput", candidate_steps=(0, 1, 3, 5, 7), probe_interval=20)
    policy = GoodputPolicy(params, 3)
    goodput_feed(policy, 0.5, 60, per_step=0.001)  # middling drafts: a short chain would be best
    assert policy.steps == 7  # and the cutoff ends the chains there, round by round
    decisions = goodput_feed(policy, 0.0, 60, per_step=0.004)
    assert any(d.steps == 0 for d in decisions)  # hopeless drafts: no drafting at all
    assert any(d.reason == "probe" and d.steps == 7 for d in decisions)  # probing drafts up to the ceiling


def test_cutoff_is_off_for_ema_and_when_disabled():
    assert EmaPolicy(DEFAULTS).draft_cutoff() is None
    params = PolicyParams(strategy="goodput", draft_cutoff=False)
    assert GoodputPolicy(params).draft_cutoff() is None
    assert make_policy(replace(params, draft_cutoff=True)).draft_cutoff() is not None


# ---- slots -----------------------------------------------------------------------------------


def test_batch_size_slots_keep_separate_candidates_and_state():
    params = PolicyParams(
        candidate_steps=(1, 3, 7),
        slots=(BatchSlot(1, (1, 3, 7)), BatchSlot(4, (0, 1))),
        warmup_batches=0,
        update_interval=1,
        ema_alpha=1.0,
    )
    policy = make_policy(params, 7)
    assert isinstance(policy, SlottedPolicy)
    assert policy.steps == 7
    decision = policy.observe(Observation(7, (6, 6, 6, 6), (7, 7, 7, 7)))  # batch of 4: the second slot
    assert policy.active == 4 and policy.steps == 1
    assert decision is not None
    policy.observe(Observation(1, (6,), (7,)))  # back to batch 1: its own state, still at 7
    assert policy.active == 1 and policy.steps == 7
    assert params.all_steps == (0, 1, 3, 7)


def test_a_looked_up_chain_is_not_counted_as_draft_steps():
    """A hybrid drafter's looked-up chain takes no model step: the round's draft time is spread over
    the model's steps alone (twelve looked-up tokens once made a step look a twelfth of its cost)."""
    policy = GoodputPolicy(PolicyParams(strategy="goodput", candidate_steps=(0, 12)), 12)
    for round_ in range(80):
        steps = 1 + round_ % 5
        model = DraftRecord((0.9,) * steps, acceptance=0.8)
        looked_up = DraftRecord((1.0,) * 12, acceptance=0.8, looked_up=True, match=4)
        # The model's chain costs 0.5 ms a step; the looked-up one, twelve tokens long, nothing.
        policy.observe(
            Observation(12, (0, 12), (steps, 12), 0.0005 * steps, 0.004, (model, looked_up), round_seconds=0.006)
        )
    assert Observation(12, (0, 12), (3, 12), chains=(model, looked_up)).draft_steps == 3
    assert policy.costs.draft_step_seconds(2) == pytest.approx(0.0005, rel=0.05)


def full_batch_policy() -> GoodputPolicy:
    """Goodput at k = 7 that has measured rounds of four confident drafted chains (batch 4)."""
    policy = GoodputPolicy(PolicyParams(strategy="goodput", candidate_steps=(7,), draft_cutoff=True), 7)
    for i in range(30):
        n = 7 if i % 2 else 4
        observe_round(policy, (n,) * 4, ((0.95,) * n,) * 4)
    return policy


# A verify forward of four rows that costs 4 ms more from the 17th token on, and next to nothing
# a token otherwise: the staircase a CPU's blocked matrix products make, made steep.
STAIRCASE = VerifyCurve(4, {n: 0.004 + 0.00001 * n + (0.004 if n > 16 else 0.0) for n in range(4, 37)})


def test_with_the_engines_verify_curve_a_full_batch_stops_short_of_a_step_up():
    """Four rows drafting: the line prices the 17th to 20th tokens like any other and they go
    on; the curve knows what they cost, and they stop at 16, as static k = 3 stops."""
    policy = full_batch_policy()
    two, three = [chain(0.95, 0.95)] * 4, [chain(0.95, 0.95, 0.95)] * 4
    assert policy.draft_cutoff()(three) == [True] * 4
    with_curve = policy.draft_cutoff(STAIRCASE)
    assert with_curve(two) == [True] * 4  # 12 to 16 tokens: next to nothing
    assert with_curve(three) == [False] * 4  # 16 to 20: the step up
    assert policy.draft_cutoff(VerifyCurve(2, STAIRCASE.seconds))(three) == [True] * 4  # another batch size's curve


def test_a_round_with_a_looked_up_chain_is_priced_by_the_line_whatever_the_curve():
    """Rows with lookups are ragged, as the timed shapes are not: once a lookup has joined the
    round, the drafted chains are priced as without a curve."""
    policy = full_batch_policy()
    keep = policy.draft_cutoff(STAIRCASE)
    keep([looked_up(6, match=4)])
    assert keep([chain(0.95, 0.95, 0.95)] * 4) == [True] * 4


def looked_up(length: int, match: int) -> Proposal:
    return Proposal([0] * length, confidence=[1.0] * length, acceptance=0.9, looked_up=True, match=match)


def test_a_looked_up_chain_goes_on_as_far_as_its_match_has_held():
    """Chains found by a 4-gram were kept whole; those found by a 1-gram lost their first token
    more often than not and never kept a second. Once verification shows it, the first run on and
    the second stop at one token, and the calibration of drafted chains learns nothing from either."""
    policy = cutoff_policy(draft_seconds=0.0005)
    greedy_rates = [list(row) for row in policy.calibration[False].rates]
    rng = random.Random(0)
    for _ in range(200):
        long_kept = 12 if rng.random() < 0.95 else rng.randrange(12)
        short_kept = 0 if rng.random() < 0.7 else 1
        chains = (DraftRecord((1.0,) * 12, looked_up=True, match=4), DraftRecord((1.0,) * 12, looked_up=True, match=1))
        verify = 0.010 + 0.0002 * 26  # as `observe_round` prices a verify of two chains of 12
        policy.observe(Observation(7, (long_kept, short_kept), (12, 12), 0.0, verify, chains, round_seconds=verify))
    assert policy.calibration[False].rates == greedy_rates
    assert policy.lookups.survival(4, 11) > 0.5 and policy.lookups.survival(1, 0) < 0.5
    long_chain, short_chain = looked_up(6, match=4), looked_up(1, match=1)
    assert policy.keep_drafting([long_chain, short_chain]) == [True, False]


def test_a_looked_up_chain_pays_for_its_verify_place_alone():
    """A looked-up token takes no draft step: it goes on where its chance of being kept beats the
    price of its place in the verify, even where a drafted chain as likely would not pay for a step."""
    policy = cutoff_policy(draft_seconds=0.004)
    token_price = policy.throughput(2) * policy.costs.verify_fit.slope()
    likely = policy.lookups.prior(3) ** 3
    assert likely > token_price
    assert policy.keep_drafting([looked_up(2, match=3)]) == [True]
    assert policy.keep_drafting([chain(0.95, 0.95, recent=0.8)]) == [False]


def test_matches_longer_than_four_tokens_learn_in_power_of_two_buckets():
    lookups = LookupCalibration()
    for _ in range(50):
        lookups.learn(20, proposed=4, accepted=0)  # chains found by 20-token matches lost their first token
    assert lookups.survival(16, 0) == lookups.survival(31, 0) < 0.2
    # Other lengths learnt nothing: each starts from the rule of succession for its bucket.
    assert lookups.survival(15, 0) == lookups.prior(8) == 9 / 10
    assert lookups.survival(4, 1) == lookups.prior(4) ** 2 == (5 / 6) ** 2


def lookup_reach(policy: GoodputPolicy, match: int) -> int:
    """How long a looked-up chain found by a `match`-token match grows before the cutoff stops it."""
    length = 1
    while length < 32 and policy.keep_drafting([looked_up(length, match)]) == [True]:
        length += 1
    return length


def test_before_any_lookup_is_judged_its_match_length_says_how_far_it_runs():
    """A flat prior proposed chains found by 1-token matches whole; the rule of succession trusts
    such a chain's next token at 2/3 and a 32-token match's at 33/34, until verification says more."""
    policy = cutoff_policy(draft_seconds=0.0005)
    assert not policy.lookups.rates
    price = policy.throughput(2) * policy.costs.verify_fit.slope()  # in tokens, as the cutoff weighs them
    weak, strong = lookup_reach(policy, 1), lookup_reach(policy, 32)
    assert (2 / 3) ** (weak + 1) <= price < (2 / 3) ** weak
    assert weak < strong
    assert strong == 32 or (33 / 34) ** (strong + 1) <= price


def serve_sampled_rows(
    policy: GoodputPolicy, rounds: int, stalled: Seq[int] = (), seed: int = 0, draft_step_seconds: float = 0.0008
) -> list[int]:
    """Rounds of four sampled rows, each draft kept with chance 0.8, drafted step by step as the
    cutoff allows and priced as the benchmark's CPU runs them (a verify 2.4 ms plus 0.165 ms a
    token, a draft step 0.8 ms plus 0.5 ms a round); the `stalled` rounds take 30 times as long,
    as when another process holds the cores. Returns each round's k."""
    rng = random.Random(seed)
    steps_taken = []
    for round_ in range(rounds):
        k = policy.steps
        keep = policy.draft_cutoff()
        chains = [Proposal([], sampled=True, acceptance=0.8, pace=2.6) for _ in range(4)]
        drafting, steps = (list(range(4)) if k > 0 else []), 0
        while drafting:
            steps += 1
            for i in drafting:
                chains[i].tokens.append(0)
                chains[i].confidence.append(0.3)
            drafting = [i for i in drafting if len(chains[i].tokens) < k]
            if drafting and keep is not None:
                drafting = [i for i, go in zip(drafting, keep([chains[i] for i in drafting])) if go]
        proposed = tuple(len(c.tokens) for c in chains)
        accepted = []
        for n in proposed:
            kept = 0
            while kept < n and rng.random() < 0.8:
                kept += 1
            accepted.append(kept)
        slow = 30 if round_ in stalled else 1
        draft_seconds = (0.0005 + draft_step_seconds * steps) * slow if steps else 0.0
        verify_seconds = (0.0024 + 0.000165 * (sum(proposed) + 4)) * slow
        records = tuple(DraftRecord(tuple(c.confidence), True, c.acceptance) for c in chains)
        round_seconds = draft_seconds + verify_seconds
        policy.observe(Observation(k, tuple(accepted), proposed, draft_seconds, verify_seconds, records, round_seconds))
        steps_taken.append(k)
    return steps_taken


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_goodput_drafts_again_once_the_machine_stops_stalling(seed: int):
    """Three rounds that stalled at the start (another process held the cores) priced drafting
    out: goodput chose k = 0, the probes that followed stopped every chain after one step, and
    nothing showed the prices were wrong for most of the run. Drafting pays here (a third more
    tokens a second than k = 0), and after the stall goodput keeps to it, but for its probes of
    k = 0: three rounds, spaced further apart each time they lose."""
    params = PolicyParams(strategy="goodput", candidate_steps=(0, 1, 2, 3, 5, 7, 32))
    steady = serve_sampled_rows(GoodputPolicy(params), 300, seed=seed)
    assert steady[100:].count(0) <= 10
    after_a_stall = serve_sampled_rows(GoodputPolicy(params), 300, stalled=(1, 2, 3), seed=seed)
    assert after_a_stall[100:].count(0) <= 15
    assert after_a_stall[-100:].count(0) <= 3  # by then a probe of k = 0 comes every 80 rounds


def test_goodput_measures_plain_decoding_now_and_then_less_often_while_it_loses():
    """Where drafting pays, k = 0 is tried three rounds at a time, each time further apart; where
    it does not, goodput turns drafting off on what it measured."""
    params = PolicyParams(strategy="goodput", candidate_steps=(0, 1, 2, 3, 5, 7, 32))
    steps = serve_sampled_rows(GoodputPolicy(params), 400, seed=0)
    starts = [i for i in range(1, len(steps)) if steps[i] == 0 and steps[i - 1] != 0]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 4 and gaps == sorted(gaps) and gaps[-1] >= 8 * params.probe_interval
    assert all(steps[i : i + 3] == [0, 0, 0] and steps[i + 3] != 0 for i in starts[-3:])

    policy = GoodputPolicy(params)
    dear = serve_sampled_rows(policy, 300, seed=0, draft_step_seconds=0.004)
    assert dear[-100:].count(0) >= 80
    assert policy.arm_rate(False, 4) > policy.arm_rate(True, 4)


def test_a_stalled_round_counts_for_at_most_a_few_times_what_was_expected():
    costs = CostModel()
    for round_ in range(60):
        steps = 1 + round_ % 5
        costs.record(
            Observation(7, (steps,) * 4, (steps,) * 4, 0.0005 + 0.0008 * steps, 0.0024 + 0.00066 * (steps + 1))
        )
    round_before, step_before = costs.round_seconds(5, 4), costs.draft_step_seconds(4)
    assert round_before is not None and step_before is not None
    costs.record(Observation(7, (5,) * 4, (5,) * 4, 0.300, 0.200))  # 60 and 30 times the usual
    # The verify of this very shape moves by a fifth of STALL_FACTOR times itself, not of 200 ms.
    assert costs.round_seconds(5, 4) < (0.8 + 0.2 * STALL_FACTOR) * round_before
    assert costs.draft_step_seconds(4) < 1.5 * step_before


def test_a_draft_step_is_never_priced_above_what_recent_rounds_paid_a_step():
    """A slope is learnt only from rounds of different lengths: once every round drafts one step,
    a slope left by rounds long gone would stand for ever. The cheapest recent rounds bound it."""
    costs = CostModel()
    for steps, seconds in [(32, 0.500), (6, 0.005), (32, 0.400), (5, 0.0045)]:  # two long rounds stalled
        costs.record(Observation(32, (0,) * 4, (steps,) * 4, seconds, 0.005))
    for _ in range(20):
        costs.record(Observation(32, (0,) * 4, (1,) * 4, 0.0014, 0.004))
    fit = costs.draft_by_steps[4]
    assert fit.slope() > 0.005  # what the line still says: 5 ms a step and more
    assert costs.draft_step_seconds(4) <= 0.0014


def test_the_cutoff_carried_through_a_round_answers_as_one_asked_afresh_each_step():
    """A round's cutoff carries each chain's survival from step to step; it must say what the
    policy says of the same chains weighed from scratch."""
    policy = cutoff_policy(draft_seconds=0.0005)
    rng = random.Random(1)
    chains = [
        Proposal([], sampled=i % 2 == 1, acceptance=rng.random(), pace=1 + 3 * rng.random()) for i in range(3)
    ] + [Proposal([], acceptance=0.8, looked_up=True, match=m, pace=2.0) for m in (1, 3, 16)]
    round_cutoff = policy.draft_cutoff()
    assert round_cutoff is not None
    going = list(range(len(chains)))
    while going:
        for i in going:
            chains[i].tokens.append(0)
            chains[i].confidence.append(1.0 if chains[i].looked_up else rng.random())
        asked = [chains[i] for i in going]
        carried = round_cutoff(asked)
        assert carried == policy.keep_drafting(asked)
        going = [i for i, go in zip(going, carried) if go and len(chains[i].tokens) < 40]
    lengths = sorted(len(c.tokens) for c in chains)
    assert lengths[0] < lengths[-1]  # chains stopped at different steps: every step was weighed


def test_a_round_cutoff_weighs_a_new_chain_afresh_whatever_came_before():
    """Chains asked about one after another, each dropped before the next is made, are each
    weighed on their own drafts (a chain's memory must not pass to a new one at the same address)."""
    policy = cutoff_policy(draft_seconds=0.0005)
    keep = policy.draft_cutoff()
    assert keep is not None
    for _ in range(20):
        assert keep([chain(0.95, 0.95, 0.95)]) == [True]
        assert keep([chain(0.95, 0.2, 0.2)]) == [False]


def test_a_lasting_slowdown_still_comes_through_in_the_prices():
    """The stall guards hold back single rounds, not a machine that stays slower."""
    costs = CostModel()

    def rounds(count: int, slower: float) -> None:
        for round_ in range(count):
            steps = 1 + round_ % 5
            draft, verify = 0.0005 + 0.0008 * steps, 0.0024 + 0.00066 * (steps + 1)
            costs.record(Observation(7, (steps,) * 4, (steps,) * 4, slower * draft, slower * verify))

    rounds(100, 1.0)
    step, round_3 = costs.draft_step_seconds(4), costs.round_seconds(3, 4)
    assert step is not None and round_3 is not None
    rounds(80, 3.0)  # three times slower from here on
    assert costs.draft_step_seconds(4) >= 0.8 * 3 * step
    assert costs.round_seconds(3, 4) >= 0.8 * 3 * round_3
