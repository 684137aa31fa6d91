"""The positional strategy: what every k would serve, from how often each draft position is kept
on the rounds served and what a round at each k costs next to a round at the k served."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence as Seq

import numpy as np

from engine.policy.contracts import Decision, Observation, RoundProfile
from engine.policy.params import PolicyParams
from engine.policy.schedule import MAX_SPACING, START_K, Schedule

# Rounds over which what is kept at each position loses half its weight: the traffic changes, and
# an old estimate must grow uncertain enough to be checked again ...
HALF_LIFE_ROUNDS = 64
# ... and what each k costs next to another: a ratio of two k's costs moves far more slowly than
# what is kept (the context's length and the machine's load fall on both sides of a comparison),
# and a few percent between two k's takes many comparisons to tell.
COST_HALF_LIFE = 4 * HALF_LIFE_ROUNDS
# A position never reached is believed as likely kept as the one before it, with this weight in
# sequences; the first position, half the time.
PRIOR_WEIGHT = 2.0
# A k is tried only while its tokens a second, this many standard errors above its estimate, beat
# the k served's: a k that might be faster is measured, one surely slower is left alone.
CONFIDENCE = 2.0
# The spread of one comparison of two k's on the log of their round seconds: a round's seconds
# vary by 6 to 9% median absolute deviation on two cores, and the median it is set against by a
# few percent more. A comparison further than CLIP from what the pair's others say (a round the
# machine stalled in) counts as that far.
COMPARISON_SPREAD = 0.09
CLIP = 3 * COMPARISON_SPREAD
# How far the seconds timed before serving (the profile, on other sequences, shorter contexts)
# are believed, as a log spread: on a published model the timed k = 7 / k = 5 ratio was 10% off
# the live one.
PROFILE_SPREAD = 0.1
# A round at another k is compared with the mean of the served k's rounds around it: this many
# just before and as many just after (a new request's shorter context falls on both sides). The
# mean, not the median: a drafter's rare dear rounds (taking in each new prompt) are what drafting
# costs, and k = 0 is spared them.
PAIRED_ROUNDS = 3
SERVED_ROUNDS = 16  # the served k's latest rounds, whose mean prices what a try loses
# Keep chances, each position's ratio kept and the sequences each rests on (PositionalPolicy);
# each k's log rate and its standard error.
Positions = tuple[list[float], list[float], list[float]]
Rates = dict[int, tuple[float, float]]
TIMED = -1  # the node of the profile in the comparisons: each k's timed seconds are c_k - c_TIMED


class Costs:
    """What a round at each k costs at one batch size, next to the k served.

    Every round at another k (a try) is compared with the mean of the served k's rounds around
    it, PAIRED_ROUNDS before and after: their log ratio, not their seconds, is kept, so that the
    context's length and the machine's load, which move both alike, cancel. A move from one k to
    another compares the last rounds of the one with the first rounds of the other. Each pair of
    k's keeps the mean of its comparisons, each weighing less as it ages (halved every
    COST_HALF_LIFE rounds); each k's cost is the least-squares fit of all of them (and of the
    profile, believed to within PROFILE_SPREAD), so that k's compared only with others are priced
    through them, and the fit says how sure each is."""

    def __init__(self, served: int, priors: dict[int, float]):
        self.served = served
        self.reference: deque[float] = deque(maxlen=SERVED_ROUNDS)  # the served k's latest rounds
        # rounds waiting for the served rounds after them: (k, its rounds, served rounds before, after)
        self.pending: list[tuple[int, list[float], list[float], list[float]]] = []
        # (i, j), i < j -> decayed weight, weighted sum of c_j - c_i, the round they were decayed to
        self.pairs: dict[tuple[int, int], list[float]] = {}
        for k, seconds in priors.items():
            self.pairs[(TIMED, k)] = [PROFILE_SPREAD**-2, PROFILE_SPREAD**-2 * seconds, math.inf]

    def add(self, k: int, seconds: float, now: int) -> None:
        if k != self.served:
            if len(self.reference) >= PAIRED_ROUNDS:
                self.pending.append((k, [seconds], list(self.reference)[-PAIRED_ROUNDS:], []))
            return
        self.reference.append(seconds)
        for waiting in self.pending:
            waiting[3].append(seconds)
            if len(waiting[3]) == PAIRED_ROUNDS:
                self._compare(*waiting, now)
        self.pending = [p for p in self.pending if len(p[3]) < PAIRED_ROUNDS]

    def _compare(self, k: int, rounds: list[float], before: list[float], after: list[float], now: int) -> None:
        """One comparison of k's rounds with the served k's rounds around them."""
        ratio = math.log(statistics.fmean(rounds)) - math.log(statistics.fmean(before + after))
        i, j, sign = (self.served, k, 1) if self.served < k else (k, self.served, -1)
        pair = self.pairs.setdefault((i, j), [0.0, 0.0, now])
        decay = 0.5 ** ((now - pair[2]) / COST_HALF_LIFE)
        pair[0], pair[1], pair[2] = pair[0] * decay, pair[1] * decay, now
        if pair[0] * COMPARISON_SPREAD**2 >= 1:  # a stalled round is held to CLIP of the others
            mean = sign * pair[1] / pair[0]
            ratio = min(max(ratio, mean - CLIP), mean + CLIP)
        weight = COMPARISON_SPREAD**-2
        pair[0] += weight
        pair[1] += weight * sign * ratio

    def ready(self) -> bool:
        """Whether a try now would have served rounds before it to be compared with."""
        return len(self.reference) >= PAIRED_ROUNDS

    def round_seconds(self) -> float | None:
        """What a round at the k served costs now: the mean of its latest rounds."""
        return statistics.fmean(self.reference) if self.reference else None

    def serve(self, k: int, now: int) -> None:
        """Serve k: the rounds of the k left wait to be compared with k's first rounds."""
        if k == self.served:
            return
        left, before = self.served, list(self.reference)[-PAIRED_ROUNDS:]
        for waiting in self.pending:  # compared with the served rounds there are
            if waiting[3]:
                self._compare(*waiting, now)
        self.served = k
        self.reference.clear()
        # The rounds left are the "try" of this comparison, the new k's first rounds its "after".
        self.pending = [(left, before, [], [])] if len(before) == PAIRED_ROUNDS else []

    def relative(self, now: int) -> dict[int, tuple[float, float]]:
        """Each k's log seconds less the served k's, and the standard error, for the k's linked to
        the served one by comparisons (the profile included)."""
        edges = {}
        for (i, j), (weight, total, at) in self.pairs.items():
            decay = 1.0 if math.isinf(at) else 0.5 ** ((now - at) / COST_HALF_LIFE)
            if weight * decay > 0:
                edges[(i, j)] = (weight * decay, total / weight)
        linked, frontier = {self.served}, [self.served]
        while frontier:
            node = frontier.pop()
            for i, j in edges:
                for a, b in ((i, j), (j, i)):
                    if a == node and b not in linked:
                        linked.add(b)
                        frontier.append(b)
        others = sorted(linked - {self.served})
        index = {k: n for n, k in enumerate(others)}
        matrix = [[0.0] * len(others) for _ in others]
        vector = [0.0] * len(others)
        for (i, j), (weight, mean) in edges.items():
            if i not in linked:
                continue
            for a, b, sign in ((i, j, -1.0), (j, i, 1.0)):
                if a in index:
                    matrix[index[a]][index[a]] += weight
                    vector[index[a]] += sign * weight * mean
                    if b in index:
                        matrix[index[a]][index[b]] -= weight
        if not others:
            return {self.served: (0.0, 0.0)}
        inverse = np.linalg.inv(np.array(matrix))  # the fit's covariance: each k's error on its diagonal
        fit = inverse @ np.array(vector)
        out = {k: (float(fit[n]), math.sqrt(max(inverse[n, n], 0.0))) for k, n in index.items() if k != TIMED}
        out[self.served] = (0.0, 0.0)
        return out


class PositionalPolicy(Schedule):
    """Choose k by what each k would have served on the rounds just served.

    A round at k says, for every shorter k, exactly how many tokens it would have emitted: a
    chain's first drafts are the same whatever its length, and so is whether each is kept. So the
    policy counts, at each draft position j, how many sequences reached j (their first j - 1
    drafts kept) and how many of those kept the j-th; the chance of keeping j drafts is the
    product of those ratios, and a k's tokens a round are 1 plus the sum of those chances up to
    k. What is kept is shared by every batch size; positions beyond the k served are counted on
    tries only, and so less surely.

    What a round at another k costs is measured next to the k served (`Costs`): a try's seconds
    over the median of the served k's rounds around it, at the same batch size, so that a longer
    context or a busier machine, which slow both, do not tell one k from another. The seconds
    timed before serving (`profile`) only start each estimate, believed to within 10%.

    The policy serves the k with the most tokens a second among those that beat the k served by
    more than their standard error. Every decision interval it may try, for a single round, the
    k whose rate CONFIDENCE standard errors up is highest, if that beats the k served's: a k
    that might be faster is measured, one surely slower is not. What is kept forgets with a
    half-life of HALF_LIFE_ROUNDS rounds and what k's cost with one of COST_HALF_LIFE, so a k
    no longer tried is tried again once its estimate has grown uncertain. Each try is charged all
    it cost (a drafter catching up after k = 0 included) beyond serving its tokens at the served
    k's rate, and the next waits until tries have lost at most `exploration` of the serving time,
    at least `probe_interval` rounds.
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
        self.batch_size = 1
        size = max(self.candidates) + 1
        self.reached = [0.0] * size  # sequences that reached position j, decayed
        self.kept = [0.0] * size  # of those, how many kept the j-th draft, decayed
        self.growth = 2 ** (1 / HALF_LIFE_ROUNDS)
        self.weight = 1.0  # the newest round's weight in those counts
        # k = 0 runs no drafter: what the drafter costs live (each new prompt taken in, catching
        # up on kept drafts) no timing before serving knows, so k = 0 has no prior.
        self.profile = {(k, b): seconds for (k, b), seconds in self.profile.items() if k > 0}
        self.timed_sizes = sorted({b for _, b in self.profile})
        self.costs: dict[int, Costs] = {}  # batch size -> what rounds cost there
        self.trying = 0  # rounds left of the current try
        self.trial: list[float] | None = None  # expected tokens and seconds of the current try
        self.next_try = 0  # the round from which another try may start
        self.after_zero = False  # whether the next round is the first at k > 0 after k = 0

    @property
    def serving(self) -> int:
        """The k served at the current batch size, between tries."""
        return self.costs_at(self.batch_size).served

    def costs_at(self, batch_size: int) -> Costs:
        if batch_size not in self.costs:
            below = [b for b in self.timed_sizes if b <= batch_size] or self.timed_sizes[:1]
            priors = {k: math.log(s) for (k, b), s in self.profile.items() if below and b == below[-1] and s > 0}
            self.costs[batch_size] = Costs(self._k, priors)
        return self.costs[batch_size]

    def keep_chances(self) -> list[float]:
        """The chance that a sequence keeps at least j drafts, for j = 0 .. the largest candidate."""
        return self._positions()[0]

    def _positions(self) -> Positions:
        """Keep chances, each position's ratio kept, and the sequences each ratio rests on."""
        chances, ratios, counts, survive, previous = [1.0], [1.0], [math.inf], 1.0, 0.5
        prior = PRIOR_WEIGHT * self.weight
        for j in range(1, len(self.reached)):
            ratio = (self.kept[j] + prior * previous) / (self.reached[j] + prior)
            survive *= ratio
            chances.append(survive)
            ratios.append(ratio)
            counts.append((self.reached[j] + prior) / self.weight)
            previous = ratio
        return chances, ratios, counts

    def tokens(self, k: int) -> float:
        """Tokens a sequence is expected to emit a round at k."""
        return sum(self.keep_chances()[: k + 1])

    @staticmethod
    def _log_tokens(k: int, served: int, positions: Positions) -> tuple[float, float]:
        """The log of k's tokens a round, and its standard error next to the k served's: from
        the positions beyond the k served only (those up to it the served rounds count for both
        alike), each ratio of p on n sequences with a log error of sqrt((1 - p) / (p n))."""
        chances, ratios, counts = positions
        tokens = sum(chances[: k + 1])
        variance = 0.0
        for j in range(served + 1, k + 1):
            p = min(max(ratios[j], 1e-3), 1 - 1e-3)
            variance += sum(chances[j : k + 1]) ** 2 * (1 - p) / (p * counts[j])
        return math.log(tokens), math.sqrt(variance) / tokens

    def log_rates(self, batch_size: int) -> Rates:
        """Each k's log tokens a second, less the k served's seconds, and its standard error next
        to the k served's, for the k's whose seconds something says."""
        costs, positions = self.costs_at(batch_size), self._positions()
        out = {}
        for k, (cost, cost_error) in costs.relative(self.rounds).items():
            if k in self.candidates:
                tokens, error = self._log_tokens(k, costs.served, positions)
                out[k] = (tokens + math.log(batch_size) - cost, math.hypot(error, cost_error))
        return out

    def rates(self, batch_size: int) -> dict[int, float]:
        """Tokens a second at each k whose seconds something says, relative to one another."""
        return {k: math.exp(rate) for k, (rate, _) in self.log_rates(batch_size).items()}

    def learn(self, observation: Observation) -> None:
        self.rounds += 1
        # Rather than every count decaying each round, each new round weighs 2^(1/half-life)
        # times the one before: the ratios read are the same, and a round costs only its own.
        self.weight *= self.growth
        if self.weight > 1e100:
            self.reached = [n / self.weight for n in self.reached]
            self.kept = [n / self.weight for n in self.kept]
            self.weight = 1.0
        w, reached, kept_at, top = self.weight, self.reached, self.kept, len(self.reached) - 1
        for kept, proposed in zip(observation.accepted, observation.proposed):
            # A pinned k may run beyond the candidates: positions past them are not counted.
            for j in range(1, min(kept, top) + 1):
                reached[j] += w
                kept_at[j] += w
            if kept < min(proposed, top):
                reached[kept + 1] += w
        first, self.after_zero = self.after_zero, False
        if not first and observation.seconds > 0:
            # A drafter left behind at k = 0 catches up in its first round after: not k's cost.
            self.costs_at(observation.batch_size).add(observation.k, observation.seconds, self.rounds)

    def observe(self, observation: Observation) -> Decision | None:
        if not observation.accepted:
            return None
        catching_up = self.after_zero
        self.learn(observation)
        b = observation.batch_size
        if self.trial is not None and (self.trying or catching_up):
            # The tokens a round at its k is expected to serve, not what this one happened to
            # keep: a single round's luck would call a try free, or dear, by chance.
            self.trial[0] += self.tokens(observation.k) * observation.batch_size
            self.trial[1] += observation.seconds
        if b != self.batch_size:
            self.batch_size, self.trying, self.trial = b, 0, None
            return self._serve_fastest(b, "batch")
        if self.trying:
            self.trying -= 1
            if self.trying:
                return None
            decision = self._serve_fastest(b, "measured")
            if not self.after_zero:  # else the drafter's catch-up, next round, is the try's too
                self._space_tries(b)
            return decision
        if self.trial is not None:
            self._space_tries(b)
        self.batches += 1
        if self.batches < self.params.warmup_batches or self.batches % self.params.update_interval:
            return None
        served, rates = self.serving, self.log_rates(b)
        decision = self._serve_fastest(b, "measured", rates)
        if decision is not None:
            return decision
        return self._try_other_k(b, rates if self.serving == served else self.log_rates(b))

    def _serve_fastest(self, b: int, reason: str, rates: Rates | None = None) -> Decision | None:
        """Serve the k with the most tokens a second among those that beat the k served by more
        than their standard error; back to the k served after a try otherwise."""
        costs = self.costs_at(b)
        rates = self.log_rates(b) if rates is None else rates
        here = rates.get(costs.served, (-math.inf, 0.0))[0]
        sure = [k for k, (rate, error) in rates.items() if rate - error > here] + [costs.served]
        best = max(sure, key=lambda k: rates[k][0] if k in rates else here)
        costs.serve(best, self.rounds)
        return None if best == self._k else self.move(best, reason)

    def _try_other_k(self, b: int, rates: Rates) -> Decision | None:
        """A round at the k whose rate, CONFIDENCE standard errors up, is highest, if that beats
        the k served's, or at one nothing prices yet: among the shorter k's (whose tokens the
        served rounds say, so only their seconds are uncertain) and the next longer one (a k
        further up is reached through it, as positions beyond are counted on tries only). Never
        sooner than probe_interval rounds after the last try, nor before the k served has rounds
        to compare it with."""
        costs = self.costs_at(b)
        if self.rounds < self.next_try or not costs.ready():
            return None
        here = costs.served
        at = self.candidates.index(here)
        reach = self.candidates[:at] + self.candidates[at + 1 : at + 2]
        bounds = {k: rates[k][0] + CONFIDENCE * rates[k][1] if k in rates else math.inf for k in reach}
        k = max(bounds, key=bounds.__getitem__, default=here)
        if k == here or bounds[k] <= rates[here][0]:
            return None
        # From k = 0 the drafter catches up in its first round: a second one measures k.
        self.trying = 2 if here == 0 else 1
        self.trial = [0, 0.0]
        self.next_try = self.rounds + self.params.probe_interval
        return self.move(k, "probe")

    def _space_tries(self, b: int) -> None:
        """Put off the next try by what this one lost against the k served, so that tries lose at
        most `exploration` of the serving time: all it cost, a drafter catching up after k = 0
        included, beyond serving its tokens at the served k's rate."""
        costs, (tokens, seconds) = self.costs_at(b), self.trial or (0, 0.0)
        self.trial = None
        served = costs.round_seconds()
        if served is None:
            return
        rate = self.tokens(costs.served) * b / served
        spacing = max(0.0, seconds - tokens / rate) / (self.params.exploration * served)
        spacing = min(MAX_SPACING * self.params.probe_interval, max(self.params.probe_interval, spacing))
        self.next_try = self.rounds + math.ceil(spacing)

    def move(self, k: int, reason: str) -> Decision:
        self.after_zero = self._k == 0 and k > 0
        return super().move(k, reason)

    def set_k(self, k: int) -> None:
        self.after_zero = self._k == 0 and k > 0
        super().set_k(k)
        self.trying, self.trial = 0, None
        self.costs_at(self.batch_size).serve(self._k, self.rounds)

    def update_params(self, params: PolicyParams) -> None:
        super().update_params(params)
        size = max(self.candidates) + 1
        self.reached = (self.reached + [0.0] * size)[:size]
        self.kept = (self.kept + [0.0] * size)[:size]
        self.trying, self.trial = 0, None
        self.costs_at(self.batch_size).serve(self._k, self.rounds)
