"""What a round costs, measured online per (drafts, batch size) and fitted elsewhere."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.policy.contracts import Observation

# How many times its expected cost a measured round is believed to have taken. A round the machine
# stalled in (another process held the cores) says nothing about the next one, and the fits forget
# slowly: a few rounds of 100 to 500 ms among rounds of 5 ms priced a draft step at 3 to 10 ms and
# a verify token at 1 ms for hundreds of rounds, and goodput chose k = 0 for most of the workload.
# A lasting change of speed still comes through, at about the pace the fits forget anyway: after
# the machine turned three times slower, prices were within a fifth of the new ones in 80 rounds.
STALL_FACTOR = 4.0


def window_rate(rounds: Seq[tuple[int, float]]) -> float:
    """Tokens per second of recent (tokens, seconds) rounds: their tokens over their seconds (a
    mean of per-round rates would weigh a round of 1 token as much as one of 6), each round held
    to STALL_FACTOR times the median, so that a few rounds the machine stalled in do not move it."""
    most = STALL_FACTOR * statistics.median(seconds for _, seconds in rounds)
    return sum(tokens for tokens, _ in rounds) / sum(min(seconds, most) for _, seconds in rounds)


def recent_low(low: float, value: float, decay: float) -> float:
    """The smallest of recent values, after `value`: it falls to a smaller value at once and rises
    towards larger ones as older values are forgotten (at `decay` a value)."""
    return value if value <= low else decay * low + (1 - decay) * value


@dataclass
class LinearFit:
    """y = a + b * x fitted to exponentially weighted observations (recent rounds count most)."""

    decay: float = 0.98
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    low: float = math.inf  # the smallest x of recent observations (`recent_low`, at the same decay)

    def plausible(self, x: float, y: float) -> float:
        """y, held to STALL_FACTOR times what the fit expects at x: its prediction, or its mean
        where that is higher (far below the mean x, the line is an extrapolation)."""
        if self.n == 0:
            return y
        return min(y, STALL_FACTOR * max(self.predict(x) or 0.0, self.sy / self.n))

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.low = recent_low(self.low, x, d)
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    @property
    def varied(self) -> bool:
        """Whether x has taken more than one value: only then is there a slope to go on."""
        if self.n == 0:
            return False
        mx = self.sx / self.n
        return self.sxx / self.n - mx * mx > 1e-6 * max(mx * mx, 1.0)

    def slope(self) -> float:
        if not self.varied:
            return 0.0
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        return max(0.0, (self.sxy / self.n - mx * my) / var)  # more tokens never cost less

    def predict(self, x: float) -> float | None:
        if self.n == 0:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        return max(my + self.slope() * (x - mx), 0.0)


@dataclass
class CostModel:
    """What a round costs: measured where this (drafts, batch size) has run, fitted elsewhere.

    Verify time is fitted against the tokens verified: each chain's drafts and the token before
    them (`Observation.verify_tokens`). Only real tokens run through the layers, and on a CPU a
    ragged batch attends a row at a time where its padding would cost more (engine.model); where
    the forward is padded whatever the chains (a graph of width k + 1), the fit sees no slope and
    prices another token at nothing. A batch of 16 on a CPU pays for 8 verify tokens each as it
    pays for one at batch 1 only while the matrix products stay memory-bound: the fit learns where
    that stops from the rounds it sees. Rounds are keyed by how far they drafted, not by their k,
    since the cutoff and max_tokens end drafting early.

    Draft time is fitted against the draft steps of each batch size once rounds of different
    lengths have run: the first step, which also feeds the tokens verification kept, costs more
    than the others, and pricing every step at the average would make short rounds look dearer
    per step than they are. Until then it is priced per step, fitted against the batch size.
    """

    smoothing: float = 0.2
    fresh_rounds: int = 50  # a direct measurement older than this many rounds gives way to the fit
    verify: dict[tuple[int, int], float] = field(default_factory=dict)  # (drafts, batch) -> seconds
    samples: dict[tuple[int, int], int] = field(default_factory=dict)
    last_seen: dict[tuple[int, int], int] = field(default_factory=dict)
    rounds: int = 0
    verify_fit: LinearFit = field(default_factory=LinearFit)
    draft_fit: LinearFit = field(default_factory=LinearFit)  # seconds per draft step, by batch
    draft_by_steps: dict[int, LinearFit] = field(default_factory=dict)  # batch -> seconds by steps
    # batch -> the fewest seconds per draft step of recent rounds (`recent_low`): no step costs
    # more at the margin than a round's steps cost on average.
    cheapest_step: dict[int, float] = field(default_factory=dict)

    def record(self, observation: Observation) -> None:
        steps = max(observation.proposed, default=0)
        drafted = observation.draft_steps
        batch_size = observation.batch_size
        key = (steps, batch_size)
        old = self.verify.get(key)
        seconds = self.verify_fit.plausible(observation.verify_tokens, observation.verify_seconds)
        if old is not None:
            seconds = min(seconds, STALL_FACTOR * old)
        self.verify[key] = seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds
        self.samples[key] = self.samples.get(key, 0) + 1
        self.rounds += 1
        self.last_seen[key] = self.rounds
        self.verify_fit.add(observation.verify_tokens, seconds)
        if drafted > 0:
            by_steps = self.draft_by_steps.setdefault(batch_size, LinearFit())
            drafting = by_steps.plausible(drafted, observation.draft_seconds)
            self.draft_fit.add(batch_size, drafting / drafted)
            by_steps.add(drafted, drafting)
            cheapest = self.cheapest_step.get(batch_size, math.inf)
            self.cheapest_step[batch_size] = recent_low(cheapest, drafting / drafted, by_steps.decay)

    def draft_seconds(self, steps: int, batch_size: int) -> float | None:
        fit = self.draft_by_steps.get(batch_size)
        step = self.draft_step_seconds(batch_size)
        if fit is not None and fit.varied and step is not None:
            # Far from the lengths seen, the line can cross zero: no step is free.
            return max(fit.predict(steps) or 0.0, steps * step)
        per_step = self.draft_fit.predict(batch_size)
        return None if per_step is None else steps * per_step

    def draft_step_seconds(self, batch_size: int) -> float | None:
        """What one more draft step costs at this batch size.

        The slope of the fit, but never more than the cheapest recent rounds cost a step on
        average. A slope is learnt only from rounds of different lengths, and the cutoff makes a
        dear step's rounds short: long rounds that stalled at the start left a slope of 9 ms a
        step, every round after stopped at one step, and nothing corrected it.
        """
        fit = self.draft_by_steps.get(batch_size)
        step = fit.slope() if fit is not None and fit.varied else self.draft_fit.predict(batch_size)
        return step if step is None else min(step, self.cheapest_step.get(batch_size, math.inf))

    def round_seconds(self, k: int, batch_size: int) -> float | None:
        key = (k, batch_size)
        # The machine's speed drifts: a k not run for a while is priced by the (decaying) fit,
        # not by what it cost back then.
        if self.samples.get(key, 0) >= 3 and self.rounds - self.last_seen[key] <= self.fresh_rounds:
            verify = self.verify[key]
        else:
            # The line is fitted where the verify forward's cost grows with its tokens; below the
            # fewest tokens recent rounds verified, its fixed part dominates and the line would
            # price a round at less than it costs (a batch of 4 without drafts at a third of its
            # cost, once chains had run long: goodput then chose k = 0 in repetitive text).
            verify = self.verify_fit.predict(max(batch_size * (k + 1), self.verify_fit.low))
        if verify is None:
            return None
        if k == 0:
            return verify
        drafting = self.draft_seconds(k, batch_size)
        return None if drafting is None else verify + drafting
