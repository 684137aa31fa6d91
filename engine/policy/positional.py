"""The positional strategy: what every k would serve, from how often each draft position is kept
on the rounds served and what a round at each k costs (timed before serving, then measured)."""

from __future__ import annotations

import itertools
import operator
import statistics
from collections import deque
from collections.abc import Sequence as Seq

from engine.confidence import count_chain, keep_ratios
from engine.policy.contracts import Decision, Observation, RoundProfile
from engine.policy.params import PolicyParams
from engine.policy.schedule import MAX_SPACING, START_K, WINDOW_ROUNDS, Schedule

# Rounds over which what was counted at a draft position loses half its weight: the traffic may
# change, and a position reached only by tries keeps its count for a while. How much is kept moves
# from request to request too; following each request's share arrives late and serves k's the
# average would not (64 rounds lost 1-1.5 points at concurrency 4 on the tuning half).
HALF_LIFE_ROUNDS = 256
# A position never reached is believed as likely kept as the one before it, with this weight in
# sequences; the first position, half the time.
PRIOR_WEIGHT = 2.0
# Rounds a k's measured seconds stay current: what a round costs moves with the traffic too (the
# context's length; a hybrid drafter's share of lookups), so k's are compared on recent rounds.
FRESH_ROUNDS = 256
# A shorter k not timed before serving is tried only while fewer of its rounds than this are
# current: the rounds served say its tokens exactly, so a try only measures its seconds, and
# their median wants a few.
SHORTER_SAMPLES = 8
# ... unless its rate on those rounds is this much below the k served's: then one current round is
# enough, as a round's seconds vary by less (6 to 9% median absolute deviation) and more of them
# would not make it win.
FAR_BEHIND = 0.1
# per_sequence: a sequence's own counts at a draft position weigh against the batch's ratio there
# as this many of its own rounds: a new sequence drafts as the batch does, after a few rounds as
# its own drafts say.
ROW_PRIOR = 4.0


class PositionalPolicy(Schedule):
    """Choose k by what each k would have served on the rounds just served.

    A round at k says, for every shorter k, exactly how many tokens it would have emitted: a
    chain's first drafts are the same whatever its length, and so is whether each is kept. So the
    policy counts, at each draft position j, how many sequences reached j (their first j - 1
    drafts kept) and how many of those kept the j-th; the chance of keeping j drafts is the
    product of those ratios, and a k's tokens a round are 1 plus the sum of those chances up to
    k. What is kept is shared by every batch size.

    A k's round seconds at a batch size are the median of its own recent rounds there once they
    fill a window. Before that, where the engine timed every k before serving (`profile`), they
    are its timed seconds times how much dearer the live rounds are than their own timed seconds
    (the contexts are longer): a single round is too noisy to set k's a few percent apart. k = 0,
    which runs no drafter, is priced by its own rounds only.

    The policy serves the k with the most tokens a second (a move must win by `switch_margin`).
    Positions beyond the k served are counted only on tries: now and then a single round runs at
    the next longer k, as often as keeps what tries lose (all they cost, a drafter catching up
    after k = 0 included) within `exploration` of the serving time. A shorter k that was timed is
    never tried: its tokens and its seconds are known. One that was not (k = 0 always) is tried
    only until a few of its rounds are current (one, while those say it is far behind), and at once
    while none is: until then the policy cannot move there.
    """

    blind_at_zero = False

    def __init__(
        self,
        params: PolicyParams,
        initial_k: int | None = None,
        candidates: Seq[int] | None = None,
        profile: RoundProfile | None = None,
    ):
        super().__init__(params, initial_k if initial_k is not None else START_K, candidates, profile)
        self.rounds = 0
        self.rounds_at: dict[int, int] = {}  # batch size -> rounds served at it
        self.batch_size = 1
        self.serving = self._k  # the k served between tries
        size = max(self.candidates) + 1
        self.reached = [0.0] * size  # sequences that reached position j, decayed
        self.kept = [0.0] * size  # of those, how many kept the j-th draft, decayed
        self.growth = 2 ** (1 / HALF_LIFE_ROUNDS)
        self.weight = 1.0  # the newest round's weight in those counts
        # (k, batch size) -> the round and seconds of k's last rounds at that batch size
        self.seconds: dict[tuple[int, int], deque[tuple[int, float]]] = {}
        self.medians: dict[tuple[int, int], float] = {}  # their medians, as last read
        self.due: dict[tuple[int, int], int] = {}  # (k, batch size) -> the round a try of k is due
        self.trying = 0  # rounds left of the current try
        self.trial = (0, 0, 0.0)  # rounds, tokens and seconds the current try has run
        # batch size -> recent rounds' seconds over what the profile says they cost: the level of
        # every k's profiled seconds now (longer contexts, another load on the machine)
        self.levels: dict[int, deque[float]] = {}
        self.level_medians: dict[int, float] = {}
        # k = 0 is measured on its own rounds only: it runs no drafter, and what the drafter costs
        # live (each new prompt taken in, catching up on kept drafts) no timing before serving
        # can know, so its timed seconds would set drafting against not drafting wrongly.
        self.profile = {(k, b): seconds for (k, b), seconds in self.profile.items() if k > 0}
        self.timed_sizes = sorted({b for _, b in self.profile})
        self.timed_size_for: dict[int, int] = {}  # batch size -> the timed batch size it is priced at
        self.after_zero = False  # whether the next round is the first at k > 0 after k = 0
        # per_sequence: request id -> (reached, kept) at each position, as the batch's above
        self.rows: dict[str, tuple[list[float], list[float]]] = {}
        self.plan: dict[str, int] | None = None
        self.planned = ((), -1)  # the ids the plan was made for, and the round it was made at

    def keep_ratios(self) -> list[float]:
        """The chance that a sequence which reached draft position j keeps its draft there, for
        j = 1 .. the largest candidate (index 0 holds 1)."""
        return keep_ratios(self.reached, self.kept, PRIOR_WEIGHT * self.weight, len(self.reached) - 1)

    def keep_chances(self) -> list[float]:
        """The chance that a sequence keeps at least j drafts, for j = 0 .. the largest candidate."""
        return list(itertools.accumulate(self.keep_ratios(), operator.mul))

    def tokens(self, k: int) -> float:
        """Tokens a sequence is expected to emit a round at k."""
        return sum(self.keep_chances()[: k + 1])

    def rates(self, batch_size: int) -> dict[int, float]:
        """Tokens a second at each k whose seconds at this batch size were measured lately: the
        median of its rounds, so that a few tries' rounds that met a new prompt (which the
        drafter takes in) or a stall of the machine do not decide what their k costs."""
        chances, rates = self.keep_chances(), {}
        for k in self.candidates:
            if seconds := self.median_seconds(k, batch_size):
                rates[k] = sum(chances[: k + 1]) * batch_size / seconds
        return rates

    def recent_seconds(self, k: int, batch_size: int) -> deque[tuple[int, float]]:
        """k's rounds at this batch size within its last FRESH_ROUNDS rounds (a batch size not
        served meanwhile keeps what was measured at it), as (round there, seconds)."""
        window = self.seconds.get((k, batch_size), deque())
        since = self.rounds_at.get(batch_size, 0) - FRESH_ROUNDS
        while window and window[0][0] < since:
            window.popleft()
            self.medians.pop((k, batch_size), None)
        return window

    def median_seconds(self, k: int, batch_size: int) -> float | None:
        """What a round at k costs at this batch size: the median of k's own recent rounds once
        they fill a window, before that its profiled seconds at the live level (single rounds are
        too noisy to compare k's a few percent apart); None if neither is known."""
        window = self.recent_seconds(k, batch_size)
        if len(window) < WINDOW_ROUNDS and (priced := self.priced_seconds(k, batch_size)) is not None:
            return priced
        if not window:
            return None
        key = (k, batch_size)
        if key not in self.medians:
            self.medians[key] = statistics.median(seconds for _, seconds in window)
        return self.medians[key]

    def profiled(self, k: int, batch_size: int) -> float | None:
        """k's round seconds in the profile, at the largest batch size timed up to this one."""
        size = self.timed_size_for.get(batch_size)
        if size is None:
            if not self.timed_sizes:
                return None
            below = [b for b in self.timed_sizes if b <= batch_size] or self.timed_sizes[:1]
            size = self.timed_size_for[batch_size] = below[-1]
        return self.profile.get((k, size))

    def priced_seconds(self, k: int, batch_size: int) -> float | None:
        """k's profiled seconds times the median of recent rounds' seconds over their own
        profiled seconds at this batch size; None before such a round."""
        profiled, ratios = self.profiled(k, batch_size), self.levels.get(batch_size)
        if profiled is None or not ratios:
            return None
        if batch_size not in self.level_medians:
            self.level_medians[batch_size] = statistics.median(ratios)
        return profiled * self.level_medians[batch_size]

    def learn(self, observation: Observation) -> None:
        self.rounds += 1
        # Rather than every count decaying each round, each new round weighs 2^(1/half-life)
        # times the one before: the ratios read are the same, and a round costs only its own.
        self.weight *= self.growth
        if self.weight > 1e100:
            self.reached = [n / self.weight for n in self.reached]
            self.kept = [n / self.weight for n in self.kept]
            self.weight = 1.0
        for kept, proposed in zip(observation.accepted, observation.proposed):
            # A pinned k may run beyond the candidates: positions past them are not counted.
            count_chain(self.reached, self.kept, kept, proposed, self.weight)
        if self.params.per_sequence:
            size = len(self.reached)
            for request, kept, proposed in zip(observation.ids, observation.accepted, observation.proposed):
                count_chain(*self.rows.setdefault(request, ([0.0] * size, [0.0] * size)), kept, proposed)
        b = observation.batch_size
        served = self.rounds_at[b] = self.rounds_at.get(b, 0) + 1
        first, self.after_zero = self.after_zero, False
        # A drafter left behind at k = 0 catches up in its first round after: not k's cost.
        if first or observation.seconds <= 0:
            return
        if self.params.per_sequence and any(proposed != observation.k for proposed in observation.proposed):
            # Rows of their own k: the round prices no single k, only how dear rounds are now.
            mean = sum(observation.proposed) / b
            self._add_level(b, observation.seconds, interpolate(self._profiled_at(b), mean))
            return
        key = (observation.k, b)
        self.seconds.setdefault(key, deque(maxlen=WINDOW_ROUNDS)).append((served, observation.seconds))
        self.medians.pop(key, None)
        self._add_level(b, observation.seconds, self.profiled(observation.k, b))

    def _add_level(self, b: int, seconds: float, profiled: float | None) -> None:
        """Count a round's seconds over what the profile says such a round costs at batch size b."""
        if profiled is not None:
            self.levels.setdefault(b, deque(maxlen=WINDOW_ROUNDS)).append(seconds / profiled)
            self.level_medians.pop(b, None)

    def _profiled_at(self, b: int) -> dict[int, float]:
        """Every candidate's profiled seconds at batch size b, where timed."""
        return {k: seconds for k in self.candidates if (seconds := self.profiled(k, b)) is not None}

    def observe(self, observation: Observation) -> Decision | None:
        if not observation.accepted:
            return None
        self.learn(observation)
        b = observation.batch_size
        if b != self.batch_size:
            self.batch_size, self.trying = b, 0
            return self._serve_fastest(b, "batch")
        if self.trying:
            self.trying -= 1
            rounds, tokens, seconds = self.trial
            self.trial = (rounds + 1, tokens + observation.tokens, seconds + observation.seconds)
            if self.trying:
                return None
            self._space_tries(b, tried=observation.k)
            # Where the k tried is now the one served, a k beside it not yet measured here is tried
            # at once: until it is, k cannot move there.
            return self._serve_fastest(b, "measured") or self._try_other_k(b, unmeasured_only=True)
        self.batches += 1
        if self.batches < self.params.warmup_batches or self.batches % self.params.update_interval:
            return None
        return self._serve_fastest(b, "measured") or self._try_other_k(b)

    def _serve_fastest(self, b: int, reason: str) -> Decision | None:
        """Move to the fastest k whose seconds are known here, when it beats the k served by
        `switch_margin` (or the k served is not known here)."""
        rates = self.rates(b)
        best = max(rates, key=rates.__getitem__) if rates else self.serving
        here = rates.get(self.serving)
        if here is not None and rates[best] <= here * (1 + self.params.switch_margin):
            best = self.serving
        self.serving = best
        return None if best == self._k else self.move(best, reason)

    def _try_other_k(self, b: int, unmeasured_only: bool = False) -> Decision | None:
        """A round at another k, if one is due: the longer neighbour of the k served, to count
        the positions beyond it and measure its seconds; a shorter k that was not timed before
        serving (its tokens the rounds served say exactly) only while fewer than SHORTER_SAMPLES
        of its rounds are current, and at once, whatever is due, while none is."""
        here = self.serving
        # A shorter k the profile prices needs no try: the rounds served already say its tokens.
        shorter = [k for k in self.candidates if k < here and self.priced_seconds(k, b) is None][::-1]
        longer = [k for k in self.candidates if k > here][:1]
        for k in shorter + longer:
            current = len(self.recent_seconds(k, b))
            waiting = self.rounds < self.due.get((k, b), 0) or (unmeasured_only and current > 0)
            enough = 1 if k < here and self._far_behind(k, b) else SHORTER_SAMPLES
            if (k < here and current >= enough) or (waiting and (k > here or current > 0)):
                continue
            # From k = 0 the drafter catches up in its first round: a second one measures k.
            self.trying, self.trial = (2 if here == 0 else 1), (0, 0, 0.0)
            self.due[(k, b)] = self.rounds + self.params.probe_interval  # until the try says
            return self.move(k, "probe")
        return None

    def _far_behind(self, k: int, b: int) -> bool:
        """Whether k serves FAR_BEHIND fewer tokens a second than the k served, on what is current."""
        rates = self.rates(b)
        return k in rates and self.serving in rates and rates[k] < (1 - FAR_BEHIND) * rates[self.serving]

    def _space_tries(self, b: int, tried: int) -> None:
        """Put off the next try of `tried` by what this one lost against the k served, so that tries
        lose at most `exploration` of the serving time: half of it for tries of the longer
        neighbour, half for tries of the shorter k's. The try is charged all it cost, a drafter
        left behind at k = 0 catching up included."""
        rate, seconds = self.rates(b).get(self.serving), self.median_seconds(self.serving, b)
        if rate is None or seconds is None:
            return
        # A shorter k is charged the tokens it is expected to serve, which the rounds served say
        # exactly, not what its single round happened to keep: a lucky round would call a k that
        # loses on average free, and bring it back at once. A longer k is charged what its rounds
        # kept: the positions beyond the k served are known only from tries, maybe long ago.
        rounds, tokens, spent = self.trial
        if tried < self.serving:
            tokens = rounds * self.tokens(tried) * b
        lost = max(0.0, spent - tokens / rate)
        # Half the budget is the longer neighbour's; the shorter k's share the other half.
        share = self.params.exploration / 2
        if tried < self.serving:
            share /= sum(k < self.serving and self.priced_seconds(k, b) is None for k in self.candidates)
        spacing = lost / (share * seconds)
        spacing = min(MAX_SPACING * self.params.probe_interval, max(self.params.probe_interval, spacing))
        self.due[(tried, b)] = self.rounds + int(spacing)

    def row_ks(self, ids: Seq[str]) -> dict[str, int] | None:
        """per_sequence: each sequence's k while the policy serves (a try runs one k for all),
        planned anew as the batch changes and every `update_interval` rounds. A sequence alone
        drafts the batch's k: its own counts would only forget the traffic before it."""
        if not self.params.per_sequence or len(ids) < 2 or self._k != self.serving:
            return None
        key = tuple(ids)
        if self.planned[0] != key or self.rounds - self.planned[1] >= self.params.update_interval:
            for gone in self.rows.keys() - set(ids):
                del self.rows[gone]
            self.plan, self.planned = self._plan(key), (key, self.rounds)
        return self.plan

    def _plan(self, ids: tuple[str, ...]) -> dict[str, int] | None:
        """Give each further draft position to the sequence most likely to keep it, as many as
        serve the most tokens a second. A round costs what a round at the sequences' mean k
        costs (the verify's width grows with the drafts in all), between the known k's."""
        b = len(ids)
        prices = {k: seconds for k in self.candidates if (seconds := self.median_seconds(k, b))}
        if len(prices) < 2:
            return None
        ratios = self.keep_ratios()
        top = max(prices)
        gains = []  # (chance of keeping it, -position, row): a row's chances fall with the position
        for row, request in enumerate(ids):
            reached, kept = self.rows.get(request, (None, None))
            survive = 1.0
            for j in range(1, top + 1):
                own_kept, own_reached = (kept[j], reached[j]) if reached is not None else (0.0, 0.0)
                survive *= (own_kept + ROW_PRIOR * ratios[j]) / (own_reached + ROW_PRIOR)
                gains.append((survive, -j, row))
        gains.sort(reverse=True)
        best, best_rate, tokens = 0, 0.0, float(b)
        for m in range(len(gains) + 1):
            if m:
                tokens += gains[m - 1][0]
            seconds = interpolate(prices, m / b)
            if seconds and tokens / seconds > best_rate:
                best, best_rate = m, tokens / seconds
        ks = [0] * b
        for _, _, row in gains[:best]:
            ks[row] += 1
        return dict(zip(ids, ks))

    def move(self, k: int, reason: str) -> Decision:
        self.after_zero = self._k == 0 and k > 0
        return super().move(k, reason)

    def set_k(self, k: int) -> None:
        self.after_zero = self._k == 0 and k > 0
        super().set_k(k)
        self.serving, self.trying = self._k, 0

    def update_params(self, params: PolicyParams) -> None:
        super().update_params(params)
        size = max(self.candidates) + 1
        self.reached = (self.reached + [0.0] * size)[:size]
        self.kept = (self.kept + [0.0] * size)[:size]
        self.serving, self.trying = self._k, 0
        self.rows, self.plan, self.planned = {}, None, ((), -1)  # the positions may differ now


def interpolate(values: dict[int, float], x: float) -> float | None:
    """values, known at some k's, at x between them (straight lines); None outside them."""
    ks = sorted(values)
    if not ks or not ks[0] <= x <= ks[-1]:
        return None
    for low, high in zip(ks, ks[1:]):
        if x <= high:
            return values[low] + (values[high] - values[low]) * (x - low) / (high - low)
    return values[ks[-1]]
