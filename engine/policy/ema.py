"""SGLang's adaptive draft length: a ladder over an EMA of accepted drafts."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.policy.contracts import Decision, Observation, RoundProfile
from engine.policy.params import PolicyParams
from engine.policy.schedule import Schedule


class EmaPolicy(Schedule):
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

    def __init__(
        self,
        params: PolicyParams,
        initial_k: int | None = None,
        candidates: Seq[int] | None = None,
        profile: RoundProfile | None = None,
    ):
        super().__init__(params, initial_k, candidates, profile)
        self._ema = float(max(self._k - 1, 0))

    @property
    def serving(self) -> int:
        """The k served (probes from k = 0 are the ladder's own moves, not tries)."""
        return self._k

    @property
    def ema(self) -> float:
        return self._ema

    def learn(self, observation: Observation) -> None:
        if self._k == 0:
            return  # nothing was drafted: the EMA stays where it was
        mean = sum(observation.accepted) / len(observation.accepted)
        self._ema = (1 - self.params.ema_alpha) * self._ema + self.params.ema_alpha * mean

    def probe_k(self) -> int:
        k = self.candidates[1]
        # Give the probe a fair hearing: start it as if it had just accepted half its drafts.
        self._ema = max(self._ema, k / 2)
        return k

    def decide(self, observation: Observation) -> Decision | None:
        c, p = self.candidates, self.params
        start = i = c.index(self._k)
        while i > 0 and self._ema <= _drop_threshold(c[i - 1]) + p.down_hysteresis:
            i -= 1
        if i == start:
            while i < len(c) - 1 and self._ema > c[i] - 0.5 + p.up_hysteresis:
                i += 1
        if i == start:
            return None
        return self.move(c[i], "down" if i < start else "up")


def _drop_threshold(lower: int) -> float:
    # SGLang's boundary below tier c is c - 0.5; for k = 0 that would never be reached (the
    # EMA is never negative), so dropping to 0 happens under half an accepted draft.
    return lower - 0.5 if lower > 0 else 0.5
