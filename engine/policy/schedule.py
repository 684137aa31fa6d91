"""What every strategy does alike around its own decision: warm-up, the decision interval,
probing from k = 0, snapping to the candidates, and parameter swaps."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq

from engine.policy.contracts import Decision, Observation, RoundProfile, snap
from engine.policy.params import PolicyParams

# What the strategies that measure k (measured, positional) share. Rounds a k's seconds are taken
# over, and the most probe intervals between tries of another k.
WINDOW_ROUNDS = 32
MAX_SPACING = 64
# Where a new engine starts (the nearest candidate): where drafting pays, as at batch 1, the best k
# is a few steps above, where it loses, as at larger batches on two cores, a few steps below.
# Chosen on the tuning half of the workload suite: from the default ladder's middle (3) a new
# engine lost 2 points at concurrency 4 (docs/benchmarks.md).
START_K = 2


class Schedule:
    """A strategy's clock. After `warmup_batches` non-empty rounds, every `update_interval`
    rounds, it asks the strategy's `decide`. At k = 0 nothing is drafted, so nothing is learnt:
    after `probe_spacing` rounds there it moves to the strategy's `probe_k` and decides again
    one interval later. Empty rounds say nothing and are not counted. A new candidate list snaps
    the current k onto it; everything learnt is kept across parameter swaps."""

    # At k = 0 nothing is drafted, so a strategy that learns from drafts learns nothing there.
    blind_at_zero = True
    # Whether the first decision comes as the warm-up ends, or one interval later (SGLang's).
    decides_at_warmup_end = False

    def __init__(
        self,
        params: PolicyParams,
        initial_k: int | None = None,
        candidates: Seq[int] | None = None,
        profile: RoundProfile | None = None,
    ):
        self.params = params
        self.profile = dict(profile or {})  # what rounds cost before serving, where timed
        self.candidates = sorted(candidates if candidates is not None else params.candidate_k)
        self._k = snap(initial_k if initial_k is not None else self.candidates[-1], self.candidates)
        self.batches = 0  # rounds observed while drafting, towards warm-up and the next decision
        self.rounds_at_zero = 0

    @property
    def k(self) -> int:
        return self._k

    @property
    def ema(self) -> float | None:
        """The acceptance EMA where the strategy keeps one (ema); None where it keeps none."""
        return None

    @property
    def probe_spacing(self) -> int:
        """Rounds at k = 0 before drafting is tried again."""
        return self.params.probe_interval

    def learn(self, observation: Observation) -> None:
        """Take in a non-empty round, whatever its k."""

    def probe_k(self) -> int:
        """The k to try after probe_spacing rounds at k = 0."""
        return self.candidates[1]

    def decide(self, observation: Observation) -> Decision | None:
        """At a decision point: `move` to another k, or None to stay."""
        raise NotImplementedError

    def move(self, k: int, reason: str) -> Decision:
        self._k = k
        self.rounds_at_zero = 0
        return Decision(k, reason)

    def observe(self, observation: Observation) -> Decision | None:
        if not observation.accepted:
            return None
        self.learn(observation)
        if self._k == 0 and self.blind_at_zero:
            self.rounds_at_zero += 1
            if self.rounds_at_zero < self.probe_spacing or len(self.candidates) == 1:
                return None
            self.batches = self.params.warmup_batches  # the warm-up was done long ago
            return self.move(self.probe_k(), "probe")
        self.batches += 1
        after_warmup = self.batches - self.params.warmup_batches
        first = 0 if self.decides_at_warmup_end else 1
        if after_warmup < first or after_warmup % self.params.update_interval:
            return None
        return self.decide(observation)

    def row_ks(self, ids: Seq[str]) -> Mapping[str, int] | None:
        """One k for the whole batch, unless a strategy plans each sequence's own."""
        return None

    def set_k(self, k: int) -> None:
        self._k = snap(k, self.candidates)
        self.rounds_at_zero = 0

    def update_params(self, params: PolicyParams) -> None:
        current = self._k
        self.params = params
        self.candidates = sorted(params.candidate_k)
        self.set_k(current)
