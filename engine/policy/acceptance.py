"""How far a chain of drafts survives, position by position."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.policy.contracts import Observation


@dataclass
class ChainAcceptance:
    """a[j] = P(draft j kept | every draft before it kept), learnt from verified rounds.

    Expected tokens of a round with k drafts: E(k) = 1 + sum_i prod_{j<=i} a[j]; a position never
    drafted follows the deepest one measured. Each a[j] is the mean of its first 1 / alpha rounds
    and an EMA after that: started from the first round and moved 5% a round, an unlucky first
    round at batch 1 (nothing kept) turned drafting off at the end of the warm-up.
    """

    alpha: float = 0.05
    rates: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # rounds that reached each depth

    def rate(self, position: int) -> float:
        if not self.rates:
            return 0.5
        return self.rates[min(position, len(self.rates) - 1)]

    def expected_tokens(self, k: int) -> float:
        total, survive = 1.0, 1.0
        for j in range(k):
            survive *= self.rate(j)
            total += survive
        return total

    def learn(self, observation: Observation) -> None:
        deepest = -1
        for j in range(max(observation.proposed, default=0)):
            reached = [a for a, p in zip(observation.accepted, observation.proposed) if a >= j and p > j]
            if not reached:
                break  # every chain ended earlier: nothing was learnt about this depth
            # The batch's requests are averaged first: a round is one observation however large
            # the batch, so a bigger batch gives a steadier estimate, not a jumpier one.
            rate = sum(1 for a in reached if a > j) / len(reached)
            if j == len(self.rates):
                self.rates.append(rate)
                self.rounds.append(0)
            self.rounds[j] += 1
            self.rates[j] += max(self.alpha, 1 / self.rounds[j]) * (rate - self.rates[j])
            deepest = j
        # Depths not drafted this round drift towards the deepest one measured, so that an old
        # estimate from a different phase does not hold a longer chain back for ever.
        if deepest >= 0:
            for j in range(deepest + 1, len(self.rates)):
                self.rates[j] += self.alpha * (self.rates[deepest] - self.rates[j])
