"""The positional strategy, through its public interface: rounds observed, decisions read."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from control.schema import policy_params
from engine.policy import Observation, PositionalPolicy, make_policy
from engine.policy import positional as policy_module
from tests.test_policy_measured import best_static, rate, run, tokens_per_second, traffic

LADDER = policy_params(strategy="positional", candidate_k=(0, 1, 2, 3, 4, 5, 7))


def test_from_a_new_engine_it_serves_about_as_fast_as_the_best_static_k():
    # The climb from k = 2 included: a new engine's first 600 rounds.
    for acceptance in (0.5, 0.85):
        serve = traffic(acceptance)
        worst = min(tokens_per_second(serve, k, 1) for k in LADDER.candidate_k)
        assert best_static(serve, 1) > 1.1 * worst  # the k matters here
        rates = [rate(run(PositionalPolicy(LADDER), serve, 600, seed=seed)) for seed in range(3)]
        assert sum(rates) / len(rates) >= 0.97 * best_static(serve, 1)


def test_where_drafting_never_pays_it_stays_at_zero_and_tries_drafting_seldom():
    serve = traffic(0.05)
    served = run(PositionalPolicy(LADDER), serve, 1000, batch_size=4)
    ks = [o.k for o in served[-600:]]
    assert ks.count(0) >= 0.95 * len(ks)
    assert 1 in ks  # it still looks now and then
    assert rate(served[-600:]) >= 0.98 * tokens_per_second(serve, 0, 4)


def test_it_follows_the_traffic_from_high_acceptance_to_hopeless_and_back():
    policy = PositionalPolicy(LADDER)
    high, hopeless = traffic(0.9), traffic(0.02)
    run(policy, high, 400)
    drafting = run(policy, high, 200, seed=3)
    assert rate(drafting) >= 0.97 * best_static(high, 1)
    # What was counted fades with a half-life of 256 rounds: after 600 rounds at 90% it takes a few
    # hundred more to stop drafting (150 leave it at k = 4, 0.54x not drafting).
    run(policy, hopeless, 450, seed=1)
    plain = run(policy, hopeless, 200, seed=4)
    assert rate(plain) >= 0.95 * best_static(hopeless, 1)
    run(policy, high, 300, seed=2)
    again = run(policy, high, 200, seed=5)
    assert rate(again) >= 0.9 * best_static(high, 1) > 1.5 * tokens_per_second(high, 0, 1)


def test_its_share_of_rounds_on_tries_shrinks_with_its_exploration_budget():
    serve = traffic(0.05)
    shares = []
    for exploration in (0.05, 0.005):
        policy = PositionalPolicy(replace(LADDER, exploration=exploration, candidate_k=(0, 1)), initial_k=0)
        ks = [o.k for o in run(policy, serve, 3000, batch_size=4)[500:]]
        shares.append(ks.count(1) / len(ks))
    assert shares[1] < shares[0] / 3
    assert shares[0] <= 0.15


def test_rounds_at_a_long_k_tell_every_shorter_k_its_tokens():
    # Every round at k = 7 keeps 2 drafts of a sequence and 6 of the other: a k = 3 round would
    # have emitted 3 and 4 tokens, 3.5 a sequence; k = 7 emitted 3 and 7, 5 a sequence.
    policy = PositionalPolicy(LADDER, initial_k=7)
    for _ in range(200):
        policy.learn(Observation(7, (2, 6), (7, 7), round_seconds=0.01))
    assert abs(policy.tokens(3) - 3.5) < 0.01
    assert abs(policy.tokens(7) - 5.0) < 0.01
    assert abs(policy.tokens(0) - 1.0) < 1e-9


def test_a_position_never_reached_is_believed_as_likely_kept_as_the_one_before():
    policy = PositionalPolicy(LADDER, initial_k=2)
    for _ in range(200):  # the first draft is kept 4 times in 5, the second always after it
        policy.learn(Observation(2, (2, 2, 2, 2, 0), (2,) * 5, round_seconds=0.01))
    chances = policy.keep_chances()
    assert abs(chances[1] - 0.8) < 0.01 and abs(chances[2] - 0.8) < 0.01
    assert abs(chances[3] - 0.8) < 0.02  # position 3, never reached: as likely as 2, always kept
    assert all(later <= earlier for earlier, later in zip(chances, chances[1:]))


def test_batch_sizes_keep_their_own_seconds_and_share_what_is_kept():
    serve = traffic(0.7, verify_token=0.0012)  # verifying is dear: drafting pays alone, not at batch 8
    assert tokens_per_second(serve, 0, 8) > tokens_per_second(serve, 1, 8)
    assert tokens_per_second(serve, 2, 1) > tokens_per_second(serve, 0, 1)
    policy = PositionalPolicy(LADDER)
    run(policy, serve, 400, batch_size=1)
    alone = policy.k
    assert alone > 0
    crowded = run(policy, serve, 400, batch_size=8)
    assert rate(crowded[-200:]) >= 0.97 * tokens_per_second(serve, 0, 8)
    decision = policy.observe(serve(policy.k, 1, random.Random(3)))  # alone again: what batch 1 measured
    assert decision is not None and decision.reason == "batch" and abs(policy.k - alone) <= 1


def test_a_parameter_swap_keeps_what_was_counted_and_snaps_k():
    serve = traffic(0.85)
    policy = PositionalPolicy(LADDER)
    run(policy, serve, 400)
    before, tokens = policy.k, policy.tokens(3)
    policy.update_params(replace(LADDER, exploration=0.05, candidate_k=(0, 2, 4, 6)))
    assert policy.k in (0, 2, 4, 6) and abs(policy.k - before) <= 1
    assert policy.tokens(3) == tokens
    served = run(policy, serve, 400, seed=1)
    assert {o.k for o in served} <= {0, 2, 4, 6}


def test_make_policy_builds_it_from_the_config_name():
    policy = make_policy(LADDER)
    assert isinstance(policy, PositionalPolicy) and policy.k == 2


def test_what_a_k_costs_is_compared_only_while_it_was_measured_lately():
    # A round's cost moves with the traffic (context length, a hybrid drafter's lookups): k = 3's
    # seconds from long ago are not set against k = 5's of now.
    policy = PositionalPolicy(replace(LADDER, candidate_k=(3, 5)), initial_k=3)
    for _ in range(20):
        policy.learn(Observation(3, (3,), (3,), round_seconds=0.005))
    policy.set_k(5)
    for _ in range(20):
        policy.learn(Observation(5, (5,), (5,), round_seconds=0.010))
    assert set(policy.rates(1)) == {3, 5}
    for _ in range(1000):
        policy.learn(Observation(5, (5,), (5,), round_seconds=0.010))
    assert set(policy.rates(1)) == {5}


def test_rounds_at_a_pinned_k_beyond_the_candidates_are_counted_up_to_them():
    policy = PositionalPolicy(LADDER)
    policy.observe(Observation(10, (10, 4), (10, 10), round_seconds=0.01))
    assert policy.keep_chances()[7] > 0


def profile_of(serve, scale: float = 1.0, batch_sizes=(1,)) -> dict[tuple[int, int], float]:
    """What the engine's timing before serving would say of `serve`: each k's seconds, here on
    contexts `scale` times as cheap as the live ones."""
    rng = random.Random(9)
    return {(k, b): scale * serve(k, b, rng).round_seconds for k in LADDER.candidate_k for b in batch_sizes}


def serve_counting_tries_down(policy: PositionalPolicy, serve, rounds: int) -> tuple[list[Observation], list[int]]:
    """Serve `rounds` rounds; also list the k's tried that were shorter than the one served."""
    rng, served, down = random.Random(0), [], []
    for _ in range(rounds):
        k = policy.k
        served.append(serve(k, 1, rng))
        decision = policy.observe(served[-1])
        if decision is not None and decision.reason == "probe" and decision.k < k:
            down.append(decision.k)
    return served, down


def test_with_rounds_timed_before_serving_it_tries_no_shorter_k_but_zero_and_climbs_sooner():
    serve = traffic(0.9, draft_step=0.0001)  # drafting is cheap: k = 7 is clearly the best
    assert tokens_per_second(serve, 7, 1) > 1.04 * max(tokens_per_second(serve, k, 1) for k in range(6))
    served, tries_down = {}, {}
    for profile in (None, profile_of(serve, scale=0.6)):  # the timed contexts were shorter
        policy = PositionalPolicy(LADDER, profile=profile)
        served[profile is not None], tries_down[profile is not None] = serve_counting_tries_down(policy, serve, 600)
    # k = 0 runs no drafter: what drafting costs live only its own rounds say, so it is still tried.
    assert set(tries_down[True]) == {0} and set(tries_down[False]) > {0}
    assert len(tries_down[True]) < len(tries_down[False]) / 2
    first_at = {timed: next(i for i, o in enumerate(rounds) if o.k == 7) for timed, rounds in served.items()}
    assert first_at[True] < first_at[False]
    assert rate(served[True]) >= 0.98 * best_static(serve, 1)


def test_a_k_timed_before_serving_is_priced_at_the_level_of_the_live_rounds():
    policy = PositionalPolicy(LADDER, initial_k=3, profile={(3, 1): 0.004, (5, 1): 0.005, (5, 4): 0.011})
    for _ in range(10):
        policy.learn(Observation(3, (3,), (3,), round_seconds=0.008))  # twice what was timed
    assert abs(policy.median_seconds(5, 1) - 0.010) < 1e-9
    assert policy.median_seconds(7, 1) is None  # not timed, never served
    assert policy.median_seconds(5, 4) is None  # no live round at batch 4 yet
    for _ in range(10):
        policy.learn(Observation(5, (5,) * 6, (5,) * 6, round_seconds=0.033))  # batch 6: timed at 4
    assert abs(policy.median_seconds(5, 6) - 0.033) < 1e-9
    for _ in range(40):  # a full window of its own rounds: k is priced by them, not by the timing
        policy.learn(Observation(5, (5,), (5,), round_seconds=0.009))
    assert abs(policy.median_seconds(5, 1) - 0.009) < 1e-9
    assert abs(policy.median_seconds(3, 1) - 0.004 * 0.009 / 0.005) < 1e-9


def test_a_shorter_k_far_behind_is_measured_on_a_round_now_and_then_not_on_a_full_median():
    serve = traffic(0.85)
    assert tokens_per_second(serve, 0, 1) < 0.8 * best_static(serve, 1)  # not drafting is far behind
    tries = {}
    for far in (0.1, 1.0):  # 1.0: never far behind, as before
        policy = PositionalPolicy(LADDER, profile=profile_of(serve))
        policy_module.FAR_BEHIND, saved = far, policy_module.FAR_BEHIND
        try:
            served, down = serve_counting_tries_down(policy, serve, 3000)
        finally:
            policy_module.FAR_BEHIND = saved
        tries[far] = down.count(0)
        assert rate(served[-1000:]) >= 0.97 * best_static(serve, 1)
    windows = 3000 / policy_module.FRESH_ROUNDS
    assert windows <= tries[0.1] + 1 <= 2 * windows + 1  # about one round a window of current rounds
    assert tries[1.0] > 3 * tries[0.1]


def mixed_rows(acceptances: dict[str, float]) -> Callable:
    """Rows that keep each draft with chances of their own; the round costs a verify of every
    row's chain and draft steps to the longest (as the drafter runs them batched)."""

    def serve(row_ks: dict[str, int], rng: random.Random) -> Observation:
        ids = tuple(acceptances)
        ks = [row_ks[i] for i in ids]
        accepted = []
        for request, k in zip(ids, ks):
            kept = 0
            while kept < k and rng.random() < acceptances[request]:
                kept += 1
            accepted.append(kept)
        seconds = (0.002 + 0.0002 * sum(k + 1 for k in ks) + 0.0004 * max(ks)) * rng.uniform(0.97, 1.03)
        return Observation(max(ks), tuple(accepted), tuple(ks), round_seconds=seconds, ids=ids)

    return serve


def serve_rounds(policy: PositionalPolicy, serve: Callable, ids: list[str], rounds: int) -> list[Observation]:
    rng, served = random.Random(3), []
    for _ in range(rounds):
        planned = policy.row_ks(ids) or {}
        served.append(serve({i: planned.get(i, policy.k) for i in ids}, rng))
        policy.observe(served[-1])
    return served


def settled_plan(policy: PositionalPolicy, serve: Callable, ids: list[str]) -> dict[str, int] | None:
    """The plan once no try of another k is due next round (a try runs one k for all)."""
    while policy.k != policy.serving:
        serve_rounds(policy, serve, ids, 1)
    return policy.row_ks(ids)


def test_per_sequence_each_row_drafts_as_its_own_acceptance_says_and_beats_every_single_k():
    acceptances = {"code": 0.9, "quote": 0.9, "prose": 0.05, "noise": 0.05}
    serve, ids = mixed_rows(acceptances), list(acceptances)
    rng = random.Random(1)
    uniform = {k: rate([serve(dict.fromkeys(ids, k), rng) for _ in range(2000)]) for k in LADDER.candidate_k}
    policy = PositionalPolicy(replace(LADDER, per_sequence=True))
    served = serve_rounds(policy, serve, ids, 800)
    assert rate(served[-400:]) >= 1.08 * max(uniform.values())
    plan = settled_plan(policy, serve, ids)
    assert plan is not None and min(plan["code"], plan["quote"]) >= 3 and max(plan["prose"], plan["noise"]) <= 1
    # One k for all without per_sequence, and for a sequence alone.
    assert PositionalPolicy(LADDER).row_ks(ids) is None
    assert policy.row_ks(["code"]) is None


def test_per_sequence_forgets_a_sequence_that_left_and_starts_a_new_one_from_the_batch():
    acceptances = {"a": 0.9, "b": 0.9}
    policy = PositionalPolicy(replace(LADDER, per_sequence=True))
    serve_rounds(policy, mixed_rows(acceptances), list(acceptances), 300)
    settled_plan(policy, mixed_rows(acceptances), list(acceptances))
    plan = policy.row_ks(["a", "new"])
    assert plan is not None and "b" not in policy.rows
    assert abs(plan["new"] - plan["a"]) <= 1  # the batch's counts are a new sequence's prior
