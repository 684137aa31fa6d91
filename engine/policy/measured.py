"""The measured strategy: each k's tokens per second, as rounds at it run, and a climb along the
candidate ladder towards the fastest."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence as Seq
from typing import NamedTuple

from engine.policy.contracts import Decision, Observation, RoundProfile
from engine.policy.params import PolicyParams
from engine.policy.schedule import MAX_SPACING, START_K, WINDOW_ROUNDS, Schedule

# How many times the median round of its window a round is believed to have taken: a round the
# machine stalled in (another process held the cores) says nothing about the next one.
STALL_FACTOR = 4.0
# How many of the most probe spacings a rate stays current after its k last ran.
FRESH_SPACINGS = 2


class Round(NamedTuple):
    tokens: int
    seconds: float
    accepted: tuple[int, ...]  # accepted drafts of each sequence


def window_rate(rounds: Seq[Round]) -> float:
    """Tokens per second of recent rounds: their tokens over their seconds (a mean of per-round
    rates would weigh a round of 1 token as much as one of 6), each round held to STALL_FACTOR
    times the median, so that a few rounds the machine stalled in do not move it."""
    return sum(r.tokens for r in rounds) / (len(rounds) * round_seconds(rounds))


def round_seconds(rounds: Seq[Round]) -> float:
    """Mean seconds of recent rounds, each held to STALL_FACTOR times their median."""
    most = STALL_FACTOR * statistics.median(r.seconds for r in rounds)
    return sum(min(r.seconds, most) for r in rounds) / len(rounds)


def tokens_at(accepted: Seq[int], k: int) -> int:
    """Tokens a round would have emitted at a draft length k no longer than the one it ran at: a
    chain's first k drafts are the same whatever its length, and so is whether each is kept
    (exactly for greedy requests and the token rule; the block rule keeps about as many)."""
    return sum(min(kept, k) + 1 for kept in accepted)


class MeasuredPolicy(Schedule):
    """Choose k by what each k was measured to serve: tokens per second of whole rounds, at the
    batch size they ran at.

    The policy keeps to the k measured fastest and now and then tries the candidates next to it on
    the ladder, for `update_interval` rounds, since the traffic may have changed: a try that wins
    is kept, one that loses is repeated only after as many rounds as keep what tries lose within
    `exploration` of the serving time (a close neighbour is tried often, a far worse one seldom),
    and a shorter neighbour that loses again waits `exploration_backoff` times longer each time;
    a neighbour put off is tried at once when the rounds served since say it would now win.
    A try is judged against the k it left on the same rounds (`paired_rates`), so that the luck
    of its few rounds does not decide it. A try is charged all it cost, its first round included,
    in which a drafter left behind at k = 0 catches up. Rates are kept per batch size, and a
    change of batch size returns to the fastest k measured there. Nothing is modelled: the
    drafter, the verification rule, the round's own work and the machine are all in the
    measurement.
    """

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
        # (k, batch size) -> the last WINDOW_ROUNDS rounds at k, and the round last seen
        self.windows: dict[tuple[int, int], tuple[deque[Round], int]] = {}
        # (k, batch size) -> the round from which trying k again is due, and how many tries of k
        # in a row have lost
        self.due: dict[tuple[int, int], int] = {}
        self.losses: dict[tuple[int, int], int] = {}
        self.probe_from: int | None = None
        self.trial = (0, 0.0)  # tokens and seconds of the current try's rounds
        self.moved = False  # whether the next round is the first after a move

    blind_at_zero = False  # k = 0 is measured like any other k

    @property
    def serving(self) -> int:
        """The k served between tries: the one a try left."""
        return self._k if self.probe_from is None else self.probe_from

    def current(self, k: int, batch_size: int) -> deque[Round] | None:
        """k's recent rounds at this batch size, while they are current."""
        window = self.windows.get((k, batch_size))
        if window is None or self.rounds - window[1] > FRESH_SPACINGS * MAX_SPACING * self.params.probe_interval:
            return None
        return window[0]

    def rate(self, k: int, batch_size: int) -> float | None:
        """Tokens per second of k's recent rounds at this batch size, while current; a round the
        machine stalled in counts for at most STALL_FACTOR times the window's median."""
        rounds = self.current(k, batch_size)
        return None if rounds is None else window_rate(rounds)

    def learn(self, observation: Observation) -> None:
        self.rounds += 1
        first, self.moved = self.moved, False
        seconds, tokens = observation.seconds, observation.tokens
        if seconds <= 0:
            return
        if self.probe_from is not None:
            self.trial = (self.trial[0] + tokens, self.trial[1] + seconds)
        if first:
            return  # the move's own cost: charged to the try, not to the k's rate
        key = (observation.k, observation.batch_size)
        window = self.windows[key][0] if key in self.windows else deque(maxlen=WINDOW_ROUNDS)
        window.append(Round(tokens, seconds, observation.accepted))
        self.windows[key] = (window, self.rounds)

    def observe(self, observation: Observation) -> Decision | None:
        if observation.accepted and observation.batch_size != self.batch_size:
            # Another batch size: what was measured there decides at once, and again one interval on.
            self.batch_size = observation.batch_size
            self.probe_from = None
            self.learn(observation)
            self.batches = self.params.warmup_batches
            best = self._fastest(observation.batch_size)
            return None if best is None or best == self._k else self.move(best, "batch")
        return super().observe(observation)

    def _fastest(self, batch_size: int) -> int | None:
        rates = {k: r for k in self.candidates if (r := self.rate(k, batch_size)) is not None}
        return max(rates, key=rates.__getitem__) if rates else None

    def decide(self, observation: Observation) -> Decision | None:
        b, here = observation.batch_size, self._k
        if self.probe_from is not None:
            return self._judge_try(b, tried=here, left=self.probe_from)
        for k in self._neighbours(here):
            if self.rounds >= self.due.get((k, b), 0) or self._would_now_win(k, here, b):
                self.probe_from, self.trial = here, (0, 0.0)
                self.windows.pop((k, b), None)  # a try measures the present
                return self.move(k, "probe")
        return None

    def _judge_try(self, b: int, tried: int, left: int) -> Decision | None:
        self.probe_from = None
        rates = self.paired_rates(tried, left, b)
        if rates is None:
            return self.move(left, "measured")
        tried_rate, left_rate = rates
        if tried_rate > left_rate * (1 + self.params.switch_margin):
            self.losses.pop((tried, b), None)
            for k in self._neighbours(tried):
                if k != left:
                    self.due.pop((k, b), None)  # the traffic changed: look further the same way soon
                    self.losses.pop((k, b), None)
            # The k left just lost on these very rounds: not tried again for probe_interval rounds.
            self.due[(left, b)] = self.rounds + self.params.probe_interval
            return None
        # What the try cost beyond serving its tokens at the rate left, in rounds of the k left:
        # the next try comes when tries have lost at most `exploration` of the time.
        tokens, seconds = self.trial
        lost = max(0.0, seconds - tokens / left_rate)
        spacing = lost / (self.params.exploration * round_seconds(self.windows[(left, b)][0]))
        # A shorter k that keeps losing is tried ever more seldom: on steady traffic each try of
        # a worse neighbour is a loss. Only a shorter one: it is judged on the longer k's whole
        # window, whose tokens at the shorter are exact, where a longer one is judged on its own
        # few rounds' luck, and backing off after an unlucky loss would stop a climb. A try that
        # served as fast, short of the margin, is a near tie: it costs little to try again.
        losses = 1
        if tried < left and tried_rate < left_rate:
            losses = self.losses[(tried, b)] = self.losses.get((tried, b), 0) + 1
        else:
            self.losses.pop((tried, b), None)
        spacing = max(self.params.probe_interval, spacing) * self.params.exploration_backoff ** (losses - 1)
        spacing = min(MAX_SPACING * self.params.probe_interval, spacing)
        self.due[(tried, b)] = self.rounds + int(spacing)
        return self.move(left, "measured")

    def _would_now_win(self, k: int, here: int, b: int) -> bool:
        """Whether neighbour k would now win on the rounds just served at `here`, its seconds as
        its last try measured them (they depend on the machine and the batch, not on the
        traffic): a try put off by earlier losses is made at once when the traffic has turned,
        and judged on its own rounds as any other. A shorter k's tokens on these rounds are known
        exactly (`tokens_at`). A longer k's are estimated: each round that kept all `here` drafts
        goes on as the longer k's own rounds went on after keeping as many. Neither is asked
        sooner than probe_interval rounds after it last ran, as `_judge_try` spaces tries."""
        tried, rounds = self.current(k, b), self.current(here, b)
        if tried is None or rounds is None or self.rounds < self.windows[(k, b)][1] + self.params.probe_interval:
            return False  # unmeasured, or it ran within the last probe interval
        if k < here:
            rates = self.paired_rates(k, here, b)
            return rates is not None and rates[0] > rates[1] * (1 + self.params.switch_margin)
        beyond = [min(kept, k) - here for r in tried for kept in r.accepted if kept >= here]
        if not beyond:
            return False
        tokens = sum(r.tokens for r in rounds)
        full = sum(kept >= here for r in rounds for kept in r.accepted)
        estimate = (tokens + full * sum(beyond) / len(beyond)) / round_seconds(tried)
        return estimate > tokens / round_seconds(rounds) * (1 + self.params.switch_margin)

    def paired_rates(self, tried: int, left: int, b: int) -> tuple[float, float] | None:
        """Tokens per second of the k tried and of the k left, both over the same rounds: those
        of the longer one, whose tokens at the shorter are known exactly (`tokens_at`), each k's
        round seconds its own. Tokens vary from round to round far more than seconds do; judged
        on the same rounds, that luck falls on both sides alike."""
        tried_rounds, left_rounds = self.current(tried, b), self.current(left, b)
        if tried_rounds is None or left_rounds is None:
            return None
        windows = {tried: tried_rounds, left: left_rounds}
        short, long = sorted((tried, left))
        rounds = windows[long]
        tokens = {long: sum(r.tokens for r in rounds), short: sum(tokens_at(r.accepted, short) for r in rounds)}
        rates = {k: tokens[k] / (len(rounds) * round_seconds(windows[k])) for k in (short, long)}
        return rates[tried], rates[left]

    def _neighbours(self, k: int) -> list[int]:
        i = self.candidates.index(k)
        return self.candidates[max(i - 1, 0) : i] + self.candidates[i + 1 : i + 2]

    def move(self, k: int, reason: str) -> Decision:
        self.moved = k != self._k
        return super().move(k, reason)

    def set_k(self, k: int) -> None:
        super().set_k(k)
        self.probe_from = None
        self.moved = True
