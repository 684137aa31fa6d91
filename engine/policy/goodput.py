"""The cost-aware strategy: expected tokens per second of measured round time."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq

from engine.policy.acceptance import ChainAcceptance
from engine.policy.calibration import Calibration, LookupCalibration
from engine.policy.contracts import Decision, DraftChain, KeepDrafting, Observation, VerifyCurve
from engine.policy.costs import CostModel, window_rate
from engine.policy.cutoff import RoundCutoff
from engine.policy.params import PolicyParams
from engine.policy.schedule import Schedule

# goodput with the cutoff: rounds a probe of plain decoding (k = 0) lasts; how far the spacing of
# probes of the choice not taken backs off (probe_interval times 1, 2, 4, 8) while probes keep
# losing; how many recent rounds the measured rates of drafting and not are taken over.
ZERO_PROBE_ROUNDS = 3
MAX_BACKOFF = 8
ARM_ROUNDS = 32


class GoodputPolicy(Schedule):
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

    decides_at_warmup_end = True

    def __init__(self, params: PolicyParams, initial_steps: int | None = None, candidates: Seq[int] | None = None):
        super().__init__(params, initial_steps, candidates)
        # Prices a full chain when choosing between k = 0 and the ceiling; the cutoff reads each
        # sequence's own recent acceptance instead.
        self.acceptance = ChainAcceptance()
        self.costs = CostModel()
        self.calibration = {False: Calibration(), True: Calibration()}  # by whether drafts are sampled
        self.lookups = LookupCalibration()
        self.batch_size = 1
        # By batch size: tokens emitted, seconds taken and rounds run recently (sums that fade).
        self.served: dict[int, tuple[float, float, float]] = {}
        self.last_goodput: dict[int, float] = {}
        # By (drafted, batch size): tokens and seconds of each of the last ARM_ROUNDS rounds (not
        # the warm-up's, while the cutoff's calibration is still learning), and the round last
        # seen (`costs.rounds`). Whether to draft at all is decided on these measured rates where
        # both are fresh: a cost model fitted on drafting rounds alone cannot price a round
        # without. Their rates are `window_rate`'s.
        self.arms: dict[tuple[bool, int], tuple[deque[tuple[int, float]], int]] = {}
        # The choice not taken is tried every probe_interval * backoff rounds; a probe that loses
        # doubles the spacing, one that wins resets it. probe_from: the k a probe left.
        self.backoff = 1
        self.probe_from: int | None = None

    @property
    def ema(self) -> float:
        """Expected accepted drafts per round at the current k (comparable with EmaPolicy.ema)."""
        return self.expected_tokens(self._steps) - 1

    def expected_tokens(self, k: int) -> float:
        return self.acceptance.expected_tokens(k)

    def learn(self, observation: Observation) -> None:
        self.costs.record(observation)
        self.batch_size = observation.batch_size
        self._measure_throughput(observation)
        for chain, proposed, accepted in zip(observation.chains, observation.proposed, observation.accepted):
            if chain.looked_up:
                self.lookups.learn(chain.match, proposed, accepted)
            else:
                self.calibration[chain.sampled].learn(chain.confidence, accepted, chain.acceptance)
        self.acceptance.learn(observation)

    @property
    def probe_spacing(self) -> int:
        return self.params.probe_interval * self.backoff

    def probe_steps(self) -> int:
        if self.probe_from is None:  # from plain decoding, not back from a probe of it
            self.probe_from = 0
            self.arms.pop((True, self.batch_size), None)  # a probe measures the present
        return self._speculating_steps(self.candidates[1])

    def decide(self, observation: Observation) -> Decision | None:
        if self.params.draft_cutoff and 0 in self.candidates and self._zero_due(observation.batch_size):
            # Drafting is measured all the time, plain decoding only when it runs: try it for a
            # few rounds now and then, as k = 0 tries drafting, so that both rates stay current.
            self.probe_from = self._steps
            self.arms.pop((False, observation.batch_size), None)
            decision = self.move(0, "probe")
            self.rounds_at_zero = self.probe_spacing - ZERO_PROBE_ROUNDS
            return decision
        return self._choose(observation.batch_size)

    def _zero_due(self, batch_size: int) -> bool:
        arm = self.arms.get((False, batch_size))
        return arm is None or self.costs.rounds - arm[1] >= self.probe_spacing

    def _fresh(self, drafted: bool, batch_size: int) -> bool:
        """Measured at this batch size since the longest a probe may be waited for, and then some."""
        arm = self.arms.get((drafted, batch_size))
        return arm is not None and self.costs.rounds - arm[1] <= 2 * MAX_BACKOFF * self.params.probe_interval

    def arm_rate(self, drafted: bool, batch_size: int) -> float | None:
        """Tokens per second of recent rounds that drafted (or did not) at this batch size, while fresh."""
        if not self._fresh(drafted, batch_size):
            return None
        return window_rate(self.arms[(drafted, batch_size)][0])

    def _measure_throughput(self, observation: Observation) -> None:
        # The whole round: the work between draft and verify is paid per round too, so a round
        # saved by drafting deeper saves it as well.
        seconds, tokens = observation.seconds, observation.tokens
        if seconds <= 0:
            return
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
        return self.move(best, "goodput")

    def set_steps(self, k: int) -> None:
        super().set_steps(k)
        self.backoff, self.probe_from = 1, None

    def draft_cutoff(self, verify_curve: VerifyCurve | None = None) -> KeepDrafting | None:
        return RoundCutoff(self, verify_curve) if self.params.draft_cutoff else None

    def keep_drafting(self, chains: Seq[DraftChain]) -> list[bool]:
        """Which of `chains` the cutoff lets draft another token, priced as of now."""
        return RoundCutoff(self)(chains)
