"""Adaptive step policies: which k the next round should use.

A policy sees every verified round (the accepted drafts of each request, the batch size, what the
round cost) and may decide to move to another k. It never touches the engine: the controller
applies its decisions between rounds.

- `EmaPolicy` follows SGLang's adaptive speculative decoding: an EMA of accepted drafts per
  request, and a threshold ladder over the sorted candidates with hysteresis.
- `GoodputPolicy` is cost-aware: it estimates how far a chain of drafts survives, position by
  position, and picks the k with the most expected tokens per second of measured round time.
  Within a round it can also cut the draft short (`draft_cutoff`): another draft step is taken
  only while the tokens it is expected to add pay for its cost at the measured throughput.
- `SlottedPolicy` keeps a separate candidate list and policy state per batch-size range.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Protocol


@dataclass(frozen=True)
class BatchSlot:
    """Candidates used while the batch holds at least `min_batch_size` sequences."""

    min_batch_size: int
    candidate_steps: tuple[int, ...]


@dataclass(frozen=True)
class PolicyParams:
    strategy: str = "ema"  # "ema" or "goodput"
    candidate_steps: tuple[int, ...] = (1, 3, 7)
    ema_alpha: float = 0.2
    warmup_batches: int = 10
    update_interval: int = 5
    up_hysteresis: float = 0.0
    down_hysteresis: float = -0.25
    slots: tuple[BatchSlot, ...] = ()
    # At k = 0 nothing is drafted, so nothing is learnt: every probe_interval rounds, try the
    # smallest k > 0 for a while.
    # Short: a dip in the estimate can send goodput to k = 0, where it learns nothing until the
    # next probe (40 rounds held it there for a fifth of the transition workload at batch 1).
    probe_interval: int = 10
    # goodput: move only when the best k is expected to beat the current one by this fraction.
    switch_margin: float = 0.05
    # goodput: end a round's drafting early when the next draft is not worth its cost.
    draft_cutoff: bool = True

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        if self.strategy not in ("ema", "goodput"):
            out.append(f"strategy must be 'ema' or 'goodput', got {self.strategy!r}")
        for name, steps in [("candidate_steps", self.candidate_steps)] + [
            (f"slots[{i}].candidate_steps", s.candidate_steps) for i, s in enumerate(self.slots)
        ]:
            if not steps:
                out.append(f"{name} must not be empty")
            elif any(k < 0 for k in steps):
                out.append(f"{name} must hold step counts >= 0, got {list(steps)}")
            elif len(set(steps)) != len(steps):
                out.append(f"{name} has duplicates: {list(steps)}")
        if not 0 < self.ema_alpha <= 1:
            out.append(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.warmup_batches < 0:
            out.append(f"warmup_batches must be >= 0, got {self.warmup_batches}")
        if self.update_interval < 1:
            out.append(f"update_interval must be >= 1, got {self.update_interval}")
        if self.probe_interval < 1:
            out.append(f"probe_interval must be >= 1, got {self.probe_interval}")
        if self.switch_margin < 0:
            out.append(f"switch_margin must be >= 0, got {self.switch_margin}")
        sizes = [s.min_batch_size for s in self.slots]
        if any(s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
            out.append(f"slots need distinct min_batch_size >= 1, got {sizes}")
        return out

    @property
    def all_steps(self) -> tuple[int, ...]:
        """Every k any slot may choose: each needs a runtime state."""
        steps = set(self.candidate_steps)
        for slot in self.slots:
            steps.update(slot.candidate_steps)
        return tuple(sorted(steps))


@dataclass(frozen=True)
class Observation:
    """One verified round, as a policy sees it."""

    k: int
    accepted: tuple[int, ...]  # accepted drafts of each request in the round
    proposed: tuple[int, ...]  # drafts proposed to each request (k, or fewer near max_tokens)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    chains: tuple[DraftChain, ...] = ()  # each request's drafts, as the calibration learns from them
    # The whole round's wall time, emitting included (not admitting new requests); 0 when unknown.
    round_seconds: float = 0.0

    @property
    def batch_size(self) -> int:
        return len(self.accepted)

    @property
    def verify_tokens(self) -> int:
        """Tokens the verify forward checked: each request's drafts and the token before them."""
        return sum(self.proposed) + self.batch_size

    @property
    def draft_steps(self) -> int:
        """Steps the drafter ran: the longest chain it drafted (a looked-up chain took none)."""
        if not self.chains:
            return max(self.proposed, default=0)
        return max((p for p, chain in zip(self.proposed, self.chains) if not chain.looked_up), default=0)


@dataclass(frozen=True)
class Decision:
    steps: int
    reason: str  # "up", "down", "probe", "goodput", "slot"
    ema: float


class Policy(Protocol):
    params: PolicyParams

    @property
    def steps(self) -> int: ...

    @property
    def ema(self) -> float: ...

    def observe(self, observation: Observation) -> Decision | None: ...

    def set_steps(self, k: int) -> None: ...

    def update_params(self, params: PolicyParams) -> None: ...

    def draft_cutoff(self, verify_curve: VerifyCurve | None = None) -> KeepDrafting | None:
        """What the drafter asks between draft steps this round, or None to draft the full k;
        `verify_curve` is the engine's, where it timed one."""
        ...


class DraftChain(Protocol):
    """One sequence's drafts in a round, as the draft cutoff weighs them and the calibration
    learns from them."""

    @property
    def confidence(self) -> Seq[float]: ...  # the drafter's probability of each proposed token

    @property
    def sampled(self) -> bool: ...  # drawn from the drafter's distribution (else its greedy choice)

    @property
    def acceptance(self) -> float: ...  # the sequence's recent acceptance when it drafted

    @property
    def looked_up(self) -> bool: ...  # found in its own context or a finished one's: no model step

    @property
    def match(self) -> int: ...  # for a looked-up chain, how many tokens before it matched

    @property
    def pace(self) -> float | None: ...  # the sequence's recent tokens per round (None: unknown)


@dataclass(frozen=True)
class DraftRecord:
    """A `DraftChain` kept after the round, without the tokens and distributions."""

    confidence: tuple[float, ...] = ()
    sampled: bool = False
    acceptance: float = 0.5
    looked_up: bool = False
    match: int = 0
    pace: float | None = None  # left unset in records: only the cutoff, on live chains, reads it


# Asked by a drafter after each draft step, with the chains of every sequence still drafting:
# which of them should draft another token (all False ends drafting for this round).
KeepDrafting = Callable[[Seq[DraftChain]], list[bool]]


@dataclass(frozen=True)
class VerifyCurve:
    """What a verify forward of a full batch cost by the tokens it checked, timed when the engine
    started (`Engine.measure_verify_curve`). On a CPU the cost is a staircase, not a line: the
    matrix products work on blocks of rows, so at batch 4 on the CPU the benchmarks run on, 16
    tokens cost 4.8 ms, 17 cost 5.4 and 20 no more than 17."""

    batch_size: int
    seconds: Mapping[int, float]  # tokens verified -> seconds

    def added(self, tokens: int, more: int) -> float | None:
        """What `more` tokens cost on top of `tokens`; None beyond the tokens timed."""
        now, then = self.seconds.get(tokens), self.seconds.get(tokens + more)
        return None if now is None or then is None else then - now


def snap(k: int, candidates: Seq[int]) -> int:
    """The candidate nearest to k; ties go to the larger."""
    return min(sorted(candidates), key=lambda c: (abs(c - k), -c))


class EmaPolicy:
    """SGLang-compatible EMA ladder.

    ema <- (1 - alpha) * ema + alpha * mean accepted drafts of the batch; after `warmup_batches`
    non-empty batches, every `update_interval` batches: go down while
    ema <= c[i-1] - 0.5 + down_hysteresis (several tiers at once if warranted), otherwise go up
    while ema > c[i] - 0.5 + up_hysteresis. The way down to k = 0 is taken when
    ema <= 0.5 + down_hysteresis (under half a draft accepted per round); at k = 0 the EMA is
    frozen and the next tier is probed every `probe_interval` batches.

    Parameter swaps: a new alpha, warm-up, interval or hysteresis keeps the EMA and counters; a
    new candidate list snaps the current k onto it and keeps the EMA.
    """

    def __init__(self, params: PolicyParams, initial_steps: int | None = None, candidates: Seq[int] | None = None):
        self.params = params
        self.candidates = sorted(candidates if candidates is not None else params.candidate_steps)
        first = snap(initial_steps if initial_steps is not None else self.candidates[-1], self.candidates)
        self.index = self.candidates.index(first)
        self._ema = float(max(first - 1, 0))
        self.batches = 0
        self.rounds_at_zero = 0

    @property
    def steps(self) -> int:
        return self.candidates[self.index]

    @property
    def ema(self) -> float:
        return self._ema

    def observe(self, observation: Observation) -> Decision | None:
        if not observation.accepted:
            return None  # an empty batch says nothing (and does not count towards warm-up)
        if self.steps == 0:
            return self._probe_from_zero()
        mean = sum(observation.accepted) / len(observation.accepted)
        self._ema = (1 - self.params.ema_alpha) * self._ema + self.params.ema_alpha * mean
        self.batches += 1
        after_warmup = self.batches - self.params.warmup_batches
        if after_warmup <= 0 or after_warmup % self.params.update_interval:
            return None
        return self._ladder()

    def _ladder(self) -> Decision | None:
        c, i, p = self.candidates, self.index, self.params
        start = i
        while i > 0 and self._ema <= _drop_threshold(c[i - 1]) + p.down_hysteresis:
            i -= 1
        if i == start:
            while i < len(c) - 1 and self._ema > c[i] - 0.5 + p.up_hysteresis:
                i += 1
        if i == start:
            return None
        self.index = i
        self.rounds_at_zero = 0
        return Decision(self.steps, "down" if i < start else "up", self._ema)

    def _probe_from_zero(self) -> Decision | None:
        self.rounds_at_zero += 1
        if self.rounds_at_zero < self.params.probe_interval or len(self.candidates) == 1:
            return None
        self.index = 1
        self.rounds_at_zero = 0
        # Give the probe a fair hearing: start it as if it had just accepted half its drafts.
        self._ema = max(self._ema, self.steps / 2)
        self.batches = self.params.warmup_batches
        return Decision(self.steps, "probe", self._ema)

    def set_steps(self, k: int) -> None:
        self.index = self.candidates.index(snap(k, self.candidates))
        self.rounds_at_zero = 0

    def update_params(self, params: PolicyParams) -> None:
        current = self.steps
        self.params = params
        self.candidates = sorted(params.candidate_steps)
        self.set_steps(current)

    def draft_cutoff(self, verify_curve: VerifyCurve | None = None) -> KeepDrafting | None:
        return None  # SGLang's ladder drafts every round to the full k


def _drop_threshold(lower: int) -> float:
    # SGLang's boundary below tier c is c - 0.5; for k = 0 that would never be reached (the
    # EMA is never negative), so dropping to 0 happens under half an accepted draft.
    return lower - 0.5 if lower > 0 else 0.5


# How many times its expected cost a measured round is believed to have taken. A round the machine
# stalled in (another process held the cores) says nothing about the next one, and the fits forget
# slowly: a few rounds of 100 to 500 ms among rounds of 5 ms priced a draft step at 3 to 10 ms and
# a verify token at 1 ms for hundreds of rounds, and goodput chose k = 0 for most of the workload.
# A lasting change of speed still comes through, at about the pace the fits forget anyway: after
# the machine turned three times slower, prices were within a fifth of the new ones in 80 rounds.
STALL_FACTOR = 4.0


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


@dataclass
class Calibration:
    """How often a draft token is kept, by the drafter's confidence in it (its probability) and
    by how much of the sequence's recent drafts the target kept.

    Both are binned; each cell's rate starts at the recent-acceptance bin's middle and follows
    what verification shows, since a distilled draft is often over- or under-confident. The recent
    acceptance matters as much as the confidence: a sequence that is repeating itself keeps
    nearly every draft even where the drafter's top probability is 0.3. Greedy and sampled
    drafts need a table each: a greedy draft is kept when it is the target's argmax, so its top
    probability says how likely that is; a sampled one is kept with min(1, p/q), so a draft with
    a flat distribution (a low q) that matches a flat target is kept as often as a confident one.
    """

    bins: int = 10
    recent_bins: tuple[float, ...] = (0.5, 0.75, 0.9)  # upper edges of the recent-acceptance bins
    alpha: float = 0.05
    rates: list[list[float]] = field(default_factory=list)
    # By recent-acceptance bin alone: how often a draft is kept, whatever its confidence. A bin
    # learns from every judged draft, several a round, so it can learn slowly and stay steady
    # (at 0.05 a rate of 0.7 wanders by +-0.07; the cutoff weighs every round by it).
    row_rates: list[float] = field(default_factory=list)
    row_alpha: float = 0.01

    def __post_init__(self) -> None:
        edges = (0.0, *self.recent_bins, 1.0)
        recent_middles = [(lo + hi) / 2 for lo, hi in zip(edges, edges[1:])]
        if not self.rates:
            self.rates = [[r] * self.bins for r in recent_middles]
        if not self.row_rates:
            self.row_rates = list(recent_middles)

    def _row(self, recent: float) -> int:
        return sum(recent >= edge for edge in self.recent_bins)

    def _cell(self, confidence: float, recent: float) -> tuple[int, int]:
        return self._row(recent), min(max(int(confidence * self.bins), 0), self.bins - 1)

    def probability(self, confidence: float, recent: float) -> float:
        row, column = self._cell(confidence, recent)
        return self.rates[row][column]

    def next_draft(self, recent: float) -> float:
        """How likely a draft not yet proposed is kept, by its sequence's recent acceptance. Where
        that acceptance does not predict the next drafts (sampled text, whose rejections come at
        random), every bin learns the same rate, and a chain's length stops following noise."""
        return self.row_rates[self._row(recent)]

    def learn(self, confidence: Seq[float], accepted: int, recent: float) -> None:
        # Drafts after the first rejected one were never judged: they teach nothing.
        for j, c in enumerate(confidence[: accepted + 1]):
            row, column = self._cell(c, recent)
            kept = 1.0 if j < accepted else 0.0
            rates = self.rates[row]
            rates[column] += self.alpha * (kept - rates[column])
            self.row_rates[row] += self.row_alpha * (kept - self.row_rates[row])


@dataclass
class LookupCalibration:
    """How far a looked-up chain holds, by the length of the n-gram match that found it: for each
    match length and depth, how often the token there is kept when every token before it was.

    A lookup has no probabilities, but the match says much: on the shipped transition workload,
    the first token of a chain found by a 4-gram was kept 98% of the time and its twelfth 88%;
    found by a 1-gram, 42% and 3%. Until verification has shown otherwise, a match of m tokens
    is trusted as Laplace's rule of succession would: after m tokens that agreed, the next agrees
    with chance (m + 1) / (m + 2), so 2/3 for a 1-token match and 33/34 for 32. (With every match
    trusted at 0.95, chains found by 1- and 2-token matches in the first greedy phase ran 16 to
    23 tokens and kept 3 to 4: 40% of the tokens verified there were never kept.) A depth past
    the deepest learnt follows the deepest.
    """

    alpha: float = 0.05
    rates: dict[int, list[float]] = field(default_factory=dict)

    @staticmethod
    def bucket(match: int) -> int:
        """Matches up to 4 tokens long are told apart by length, longer ones by powers of two
        (4-7, 8-15, 16-31, 32): each bucket has to learn its own rates."""
        return match if match <= 4 else 1 << (match.bit_length() - 1)

    def prior(self, match: int) -> float:
        """The rate a bucket starts from: the rule of succession for its shortest match."""
        shortest = self.bucket(match)
        return (shortest + 1) / (shortest + 2)

    def rate(self, match: int, depth: int) -> float:
        """How often the token at `depth` (0 is the first) is kept when every one before it was."""
        rates = self.rates.get(self.bucket(match))
        return rates[min(depth, len(rates) - 1)] if rates else self.prior(match)

    def survival(self, match: int, depth: int) -> float:
        """The chance that the token at `depth` and every one before it are kept."""
        return math.prod(self.rate(match, j) for j in range(depth + 1))

    def learn(self, match: int, proposed: int, accepted: int) -> None:
        rates = self.rates.setdefault(self.bucket(match), [])
        # Tokens after the first rejected one were never judged: they teach nothing.
        for j in range(min(proposed, accepted + 1)):
            if j == len(rates):
                rates.append(rates[-1] if rates else self.prior(match))
            rates[j] += self.alpha * ((1.0 if j < accepted else 0.0) - rates[j])


# goodput with the cutoff: rounds a probe of plain decoding (k = 0) lasts; how far the spacing of
# probes of the choice not taken backs off (probe_interval times 1, 2, 4, 8) while probes keep
# losing; how many recent rounds the measured rates of drafting and not are taken over.
ZERO_PROBE_ROUNDS = 3
MAX_BACKOFF = 8
ARM_ROUNDS = 32


class GoodputPolicy:
    """Cost-aware: choose the k that maximises expected tokens per second.

    Acceptance is estimated per chain position: a[j] = P(draft j kept | drafts before it kept),
    each the mean of its first rounds and then an EMA, so a draft that is good for two tokens
    and then wanders is seen as such. Expected tokens of a round with k drafts:
    E(k) = 1 + sum_i prod_{j<i} a[j] (positions never measured follow the deepest measured rate).
    Round cost comes from `CostModel`: measured for the (k, batch size) pairs that have run,
    fitted for the others, so the best k shrinks as the batch grows. k = 0 is chosen when no
    k > 0 beats plain decoding; from there the smallest k > 0 is probed every `probe_interval`
    rounds.

    With `draft_cutoff`, k is the most a round drafts, and the policy only decides whether to
    draft at all (k = 0 or the largest candidate): after each draft step it weighs, summed over
    the chains, the tokens their next drafts are expected to add (the chance that every draft so
    far survives, from the drafter's calibrated confidence, times how often drafts of sequences
    with its recent acceptance are kept) against what they cost. A token is worth the time it
    saves its sequence's batch slot: more for a sequence that emits few tokens a round than for
    one that emits many (`token_worth`). The chains whose next drafts save the most go on, as
    many as pay for the draft step together and each for its own verify token. Rounds of
    confident chains run long and doubtful ones stop early, chain by chain and round by round. A
    looked-up chain takes no draft step: each of its tokens goes on while the chance it is kept
    (`LookupCalibration`) pays for its verify place.
    """

    def __init__(self, params: PolicyParams, initial_steps: int | None = None, candidates: Seq[int] | None = None):
        self.params = params
        self.candidates = sorted(candidates if candidates is not None else params.candidate_steps)
        self._steps = snap(initial_steps if initial_steps is not None else self.candidates[-1], self.candidates)
        self.position_rates: list[float] = []
        self.position_rounds: list[int] = []  # rounds that reached each depth
        # Weight of the newest round in the position rates, which price a full chain when choosing
        # between k = 0 and the ceiling. Smaller than the ema strategy's alpha: at batch 1 a
        # round shows one kept-or-not per depth, and at 0.2 the rates swung by +-0.15, at times
        # choosing k = 0. The cutoff reads each sequence's own recent acceptance instead.
        self.rate_alpha = 0.05
        self.costs = CostModel()
        self.calibration = {False: Calibration(), True: Calibration()}  # by whether drafts are sampled
        self.lookups = LookupCalibration()
        self.batch_size = 1
        # By batch size: tokens emitted, seconds taken and rounds run recently (sums that fade).
        self.served: dict[int, tuple[float, float, float]] = {}
        self.batches = 0
        self.rounds_at_zero = 0
        self.last_goodput: dict[int, float] = {}
        # By (drafted, batch size): tokens and seconds of each of the last ARM_ROUNDS rounds (not
        # the warm-up's, while the cutoff's calibration is still learning), and the round last
        # seen (`costs.rounds`). Whether to draft at all is decided on these measured rates where
        # both are fresh: a cost model fitted on drafting rounds alone cannot price a round
        # without. A rate is the window's tokens over its seconds (a median of per-round rates
        # would undercount drafting, whose rounds emit 1 token or 6 at about the same cost), each
        # round's seconds held to STALL_FACTOR times the window's median, so a few stalled rounds
        # do not move it.
        self.arms: dict[tuple[bool, int], tuple[deque[tuple[int, float]], int]] = {}
        # The choice not taken is tried every probe_interval * backoff rounds; a probe that loses
        # doubles the spacing, one that wins resets it. probe_from: the k a probe left.
        self.backoff = 1
        self.probe_from: int | None = None

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def ema(self) -> float:
        """Expected accepted drafts per round at the current k (comparable with EmaPolicy.ema)."""
        return self.expected_tokens(self._steps) - 1

    def expected_tokens(self, k: int) -> float:
        total, survive = 1.0, 1.0
        for j in range(k):
            survive *= self._rate(j)
            total += survive
        return total

    def _rate(self, position: int) -> float:
        if not self.position_rates:
            return 0.5
        return self.position_rates[min(position, len(self.position_rates) - 1)]

    def _learn(self, observation: Observation) -> None:
        alpha = self.rate_alpha
        deepest = -1
        for j in range(max(observation.proposed, default=0)):
            reached = [a for a, p in zip(observation.accepted, observation.proposed) if a >= j and p > j]
            if not reached:
                break  # every chain ended earlier: nothing was learnt about this depth
            # The batch's requests are averaged first: a round is one observation however large
            # the batch, so a bigger batch gives a steadier estimate, not a jumpier one.
            rate = sum(1 for a in reached if a > j) / len(reached)
            if j == len(self.position_rates):
                self.position_rates.append(rate)
                self.position_rounds.append(0)
            self.position_rounds[j] += 1
            # Until a depth has seen 1 / alpha rounds its rate is their mean. Started from the
            # first round and moved 5% a round, an unlucky first round at batch 1 (nothing kept)
            # had goodput turn drafting off at the end of the warm-up, and probe back and forth
            # for 55 rounds, 20 of them at k = 0 (every run of the transition workload).
            self.position_rates[j] += max(alpha, 1 / self.position_rounds[j]) * (rate - self.position_rates[j])
            deepest = j
        # Depths not drafted this round drift towards the deepest one measured, so that an old
        # estimate from a different phase does not hold a longer chain back for ever.
        for j in range(deepest + 1, len(self.position_rates)):
            if deepest >= 0:
                self.position_rates[j] += alpha * (self.position_rates[deepest] - self.position_rates[j])

    def observe(self, observation: Observation) -> Decision | None:
        if not observation.accepted:
            return None
        self.costs.record(observation)
        self.batch_size = observation.batch_size
        self._measure_throughput(observation)
        for chain, proposed, accepted in zip(observation.chains, observation.proposed, observation.accepted):
            if chain.looked_up:
                self.lookups.learn(chain.match, proposed, accepted)
            else:
                self.calibration[chain.sampled].learn(chain.confidence, accepted, chain.acceptance)
        if self._steps == 0:
            self.rounds_at_zero += 1
            if self.rounds_at_zero >= self._probe_spacing and len(self.candidates) > 1:
                self.rounds_at_zero = 0
                # Decide again after one interval of probing (the warm-up was done long ago).
                self.batches = self.params.warmup_batches
                self._steps = self._speculating_steps(self.candidates[1])
                if self.probe_from is None:  # from plain decoding, not back from a probe of it
                    self.probe_from = 0
                    self.arms.pop((True, observation.batch_size), None)  # a probe measures the present
                return Decision(self._steps, "probe", self.ema)
            return None
        self._learn(observation)
        self.batches += 1
        after_warmup = self.batches - self.params.warmup_batches
        if after_warmup < 0 or after_warmup % self.params.update_interval:
            return None
        if self.params.draft_cutoff and 0 in self.candidates and self._zero_due(observation.batch_size):
            # Drafting is measured all the time, plain decoding only when it runs: try it for a
            # few rounds now and then, as k = 0 tries drafting, so that both rates stay current.
            self.probe_from = self._steps
            self._steps, self.rounds_at_zero = 0, self._probe_spacing - ZERO_PROBE_ROUNDS
            self.arms.pop((False, observation.batch_size), None)
            return Decision(0, "probe", self.ema)
        return self._choose(observation.batch_size)

    @property
    def _probe_spacing(self) -> int:
        return self.params.probe_interval * self.backoff

    def _zero_due(self, batch_size: int) -> bool:
        arm = self.arms.get((False, batch_size))
        return arm is None or self.costs.rounds - arm[1] >= self._probe_spacing

    def _fresh(self, drafted: bool, batch_size: int) -> bool:
        """Measured at this batch size since the longest a probe may be waited for, and then some."""
        arm = self.arms.get((drafted, batch_size))
        return arm is not None and self.costs.rounds - arm[1] <= 2 * MAX_BACKOFF * self.params.probe_interval

    def arm_rate(self, drafted: bool, batch_size: int) -> float | None:
        """Tokens per second of recent rounds that drafted (or did not) at this batch size, while fresh."""
        if not self._fresh(drafted, batch_size):
            return None
        rounds = self.arms[(drafted, batch_size)][0]
        most = STALL_FACTOR * statistics.median(seconds for _, seconds in rounds)
        return sum(tokens for tokens, _ in rounds) / sum(min(seconds, most) for _, seconds in rounds)

    def _measure_throughput(self, observation: Observation) -> None:
        # The whole round: the work between draft and verify is paid per round too, so a round
        # saved by drafting deeper saves it as well.
        seconds = observation.round_seconds or observation.draft_seconds + observation.verify_seconds
        if seconds <= 0:
            return
        tokens = sum(observation.accepted) + observation.batch_size
        old_tokens, old_seconds, old_rounds = self.served.get(observation.batch_size, (0.0, 0.0, 0.0))
        self.served[observation.batch_size] = (
            0.95 * old_tokens + tokens,
            0.95 * old_seconds + seconds,
            0.95 * old_rounds + 1,
        )
        drafted = max(observation.proposed, default=0) > 0
        if drafted and self.batches < self.params.warmup_batches:
            return
        key = (drafted, observation.batch_size)
        rounds = self.arms[key][0] if key in self.arms else deque(maxlen=ARM_ROUNDS)
        rounds.append((tokens, seconds))
        self.arms[key] = (rounds, self.costs.rounds)

    def throughput(self, batch_size: int) -> float | None:
        """Tokens per second of recent rounds at this batch size: summed tokens over summed seconds,
        since a mean of per-round rates would weigh a short round as much as a long one."""
        served = self.served.get(batch_size)
        return served[0] / served[1] if served else None

    def token_worth(self, chain: DraftChain) -> float | None:
        """Seconds of serving a token gained by `chain` saves. A sequence holds its batch slot for
        as many rounds as its output takes, and the slots' time is the whole run's time (one
        slot's share of it per batch slot), so a token of a sequence that emits n a round saves
        round_time / (n * batch_size): a slow sequence's tokens are worth more than a fast one's.
        In a batch that moves evenly that is one over the batch's throughput."""
        served = self.served.get(self.batch_size)
        if served is None or chain.pace is None:
            rate = self.throughput(self.batch_size) or self.goodput(self._steps, self.batch_size)
            return None if rate is None else 1 / rate
        round_seconds = served[1] / served[2]
        return round_seconds / (max(chain.pace, 1.0) * self.batch_size)

    def draft_cutoff(self, verify_curve: VerifyCurve | None = None) -> KeepDrafting | None:
        return RoundCutoff(self, verify_curve) if self.params.draft_cutoff else None

    def keep_drafting(self, chains: Seq[DraftChain]) -> list[bool]:
        """Which of `chains` the cutoff lets draft another token, priced as of now."""
        return RoundCutoff(self)(chains)

    def _speculating_steps(self, k: int) -> int:
        # With the cutoff, each round stops drafting where it stops paying: k is only a ceiling.
        return self.candidates[-1] if self.params.draft_cutoff and k > 0 else k

    def goodput(self, k: int, batch_size: int) -> float | None:
        seconds = self.costs.round_seconds(k, batch_size)
        if seconds is None or seconds <= 0:
            return None
        return self.expected_tokens(k) * batch_size / seconds

    def _choose(self, batch_size: int) -> Decision | None:
        estimates = {k: self.goodput(k, batch_size) for k in self.candidates}
        known = {k: v for k, v in estimates.items() if v is not None}
        if self.params.draft_cutoff:
            # Whatever k drafting with a full chain would favour, the cutoff does at least as well
            # from the ceiling: the choice left is whether to draft at all, measured where both
            # have run lately, else estimated.
            drafting = [v for k, v in known.items() if k > 0]
            known = {k: v for k, v in known.items() if k == 0}
            if drafting:
                known[self.candidates[-1]] = max(drafting)
            plain, drafted = self.arm_rate(False, batch_size), self.arm_rate(True, batch_size)
            if plain is not None and drafted is not None and 0 in self.candidates:
                known = {0: plain, self.candidates[-1]: drafted}
        self.last_goodput = known
        # A forced k below the ceiling moves up to it; after a probe, the probed choice must win
        # against the one it left by the margin.
        here = self._speculating_steps(self._steps if self.probe_from is None else self.probe_from)
        current = known.get(here)
        if current is None:
            return None
        best = max(known, key=lambda k: known[k])
        if known[best] <= current * (1 + self.params.switch_margin):
            best = here
        if self.probe_from is not None:
            self.backoff = min(MAX_BACKOFF, 2 * self.backoff) if best == here else 1
            self.probe_from = None
        elif best != self._steps:
            self.backoff = 1  # the traffic changed: look at the choice left again soon
        if best == self._steps:
            return None
        self._steps = best
        self.rounds_at_zero = 0
        return Decision(best, "goodput", self.ema)

    def set_steps(self, k: int) -> None:
        self._steps = snap(k, self.candidates)
        self.rounds_at_zero = 0
        self.backoff, self.probe_from = 1, None

    def update_params(self, params: PolicyParams) -> None:
        current = self._steps
        self.params = params
        self.candidates = sorted(params.candidate_steps)
        self.set_steps(current)


class RoundCutoff:
    """The goodput cutoff for one round (`KeepDrafting`), asked after each draft step.

    A draft step costs about the same however few of its rows go on (a row is a fifteenth of the
    step at batch 4), while each chain that goes on adds its own token to the verify forward
    (whose rows attend one at a time where padding would cost more). So the chains whose next
    drafts save the most go on, as many as pay for the step together and each for its token; all
    in seconds. The prices do not change within a round and are read once; a chain's chance that
    every draft so far is kept grows by a factor a step and is carried from call to call, rather
    than taken over all its drafts at every step.
    """

    def __init__(self, policy: GoodputPolicy, verify_curve: VerifyCurve | None = None) -> None:
        self.policy = policy
        self.step_seconds = policy.costs.draft_step_seconds(policy.batch_size)
        self.token_seconds = policy.costs.verify_fit.slope()
        # Read where every row of a full batch is still drafting: its timed shapes are those.
        self.curve = verify_curve if verify_curve is not None and verify_curve.batch_size == policy.batch_size else None
        # id(chain) -> (the chain, held so that its id is not reused; drafts weighed; all kept)
        self.survived: dict[int, tuple[DraftChain, int, float]] = {}

    def __call__(self, chains: Seq[DraftChain]) -> list[bool]:
        worth = [self.policy.token_worth(chain) for chain in chains]
        if self.step_seconds is None or any(w is None for w in worth):
            return [True] * len(chains)  # nothing measured yet: draft the full k
        saved = [self.next_draft_gain(chain) * w for chain, w in zip(chains, worth)]
        token_seconds = self.token_seconds
        chosen = {i for i, chain in enumerate(chains) if chain.looked_up and saved[i] > token_seconds}
        drafted = [i for i, chain in enumerate(chains) if not chain.looked_up]
        ranked = sorted(drafted, key=lambda i: -saved[i])
        going_on = None
        curve = self.curve if self._on_the_curve(chains) else None
        if curve is not None:
            tokens = len(chains) + sum(len(chain.confidence) for chain in chains)
            going_on = self._most_that_pay(ranked, saved, lambda count: curve.added(tokens, count))
        if going_on is None:
            going_on = self._most_that_pay(ranked, saved, lambda count: count * token_seconds)
        chosen.update(ranked[:going_on])
        return [i in chosen for i in range(len(chains))]

    def _on_the_curve(self, chains: Seq[DraftChain]) -> bool:
        """Whether the verify is priced by the engine's timed curve rather than the fitted line,
        which prices a token alike wherever it falls: where every row of the batch is drafted by
        the model and still drafting, the shapes the curve timed. Rounds of four sampled rows on
        the CPU then verify 16 tokens, the most before the curve steps up, as static k = 3 does,
        rather than 12 or 17 to 20. Not once a lookup joined the round: its rows are ragged, as
        the curve's are not."""
        return (
            self.curve is not None
            and len(chains) == self.curve.batch_size
            and not any(chain.looked_up for chain, _, _ in self.survived.values())
        )

    def _most_that_pay(
        self, ranked: Seq[int], saved: Seq[float], verify_seconds: Callable[[int], float | None]
    ) -> int | None:
        """How many of the chains `ranked` (the most saving first) go on: as many as save the most
        beyond the draft step and `verify_seconds(count)`, what verifying their next drafts adds;
        None where that is not known for some count (beyond the tokens a curve timed)."""
        best, going_on, gained = 0.0, 0, 0.0
        for count, i in enumerate(ranked, start=1):
            verify = verify_seconds(count)
            if verify is None:
                return None
            gained += saved[i]
            surplus = gained - self.step_seconds - verify
            if surplus > best:
                best, going_on = surplus, count
        return going_on

    def next_draft_gain(self, chain: DraftChain) -> float:
        """The chance the chain's next draft is kept: every draft so far must be (the drafter's
        calibrated confidence in each), and then it is as often as drafts of sequences with the
        chain's recent acceptance are. Its own recent acceptance follows a change of traffic at
        once, where rates pooled over all sequences lag behind, and the calibration says how much
        it predicts. Deeper drafts are worth less still, so if the next does not pay, no later
        does. A looked-up token is kept as often as tokens at its depth found by as long a match."""
        drafts = len(chain.confidence)
        _, weighed, survive = self.survived.get(id(chain), (chain, 0, 1.0))
        for j in range(weighed, drafts):
            survive *= self._kept(chain, j)
        self.survived[id(chain)] = (chain, drafts, survive)
        if chain.looked_up:
            return survive * self.policy.lookups.rate(chain.match, drafts)
        return survive * self.policy.calibration[chain.sampled].next_draft(chain.acceptance)

    def _kept(self, chain: DraftChain, j: int) -> float:
        """How likely the chain's draft j is kept when every one before it was."""
        if chain.looked_up:
            return self.policy.lookups.rate(chain.match, j)
        return self.policy.calibration[chain.sampled].probability(chain.confidence[j], chain.acceptance)


_STRATEGIES = {"ema": EmaPolicy, "goodput": GoodputPolicy}


class SlottedPolicy:
    """One inner policy per batch-size slot; the slot is the largest min_batch_size <= batch."""

    def __init__(self, params: PolicyParams, initial_steps: int | None = None):
        self.params = params
        self.slots = self._build(params, initial_steps)
        self.active = min(self.slots)

    @staticmethod
    def _build(params: PolicyParams, initial_steps: int | None) -> dict[int, Policy]:
        slots = {s.min_batch_size: s.candidate_steps for s in params.slots}
        slots.setdefault(1, params.candidate_steps)
        make = _STRATEGIES[params.strategy]
        return {size: make(params, initial_steps, steps) for size, steps in slots.items()}

    def slot_for(self, batch_size: int) -> int:
        return max((s for s in self.slots if s <= max(batch_size, 1)), default=min(self.slots))

    @property
    def steps(self) -> int:
        return self.slots[self.active].steps

    @property
    def ema(self) -> float:
        return self.slots[self.active].ema

    def observe(self, observation: Observation) -> Decision | None:
        if not observation.accepted:
            return None
        slot = self.slot_for(observation.batch_size)
        moved = slot != self.active
        self.active = slot
        decision = self.slots[slot].observe(observation)
        if decision is None and moved:
            return Decision(self.steps, "slot", self.ema)
        return decision

    def set_steps(self, k: int) -> None:
        self.slots[self.active].set_steps(k)

    def draft_cutoff(self, verify_curve: VerifyCurve | None = None) -> KeepDrafting | None:
        return self.slots[self.active].draft_cutoff(verify_curve)

    def update_params(self, params: PolicyParams) -> None:
        if params.strategy != self.params.strategy or {s.min_batch_size for s in params.slots} != {
            s.min_batch_size for s in self.params.slots
        }:
            # Another strategy or other slot boundaries: start afresh from the current k.
            current = self.steps
            self.params = params
            self.slots = self._build(params, current)
            self.active = min(self.slots)
            return
        self.params = params
        lists = {s.min_batch_size: s.candidate_steps for s in params.slots}
        lists.setdefault(1, params.candidate_steps)
        for size, policy in self.slots.items():
            policy.update_params(replace(params, candidate_steps=lists[size]))


def make_policy(params: PolicyParams, initial_steps: int | None = None) -> Policy:
    if params.slots:
        return SlottedPolicy(params, initial_steps)
    return _STRATEGIES[params.strategy](params, initial_steps)
