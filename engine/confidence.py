"""The one rule that decides, before the target sees them, which drafts a round verifies.

A drafter reports, for each draft it proposes, its confidence that the target will keep it (a
chain drafter the probability it gave the draft, a block drafter the product of its positions'
up to that one: it drafts them side by side, not one from another). A round verifies the drafts
before the first one whose confidence is below the floor. The rule is lossless whatever the floor:
it is applied before the target looks, and never by the value of a sampled draft itself, only by
the drafter's largest probability at its position (a sampled draft dropped for its own value would
bend the distribution the target's rejection rule corrects).

A drafter that drafts a step at a time applies `keeps` as it goes, sparing the steps after the cut
(the compiled chains take `floor` as data); the engine then applies `verified` to whatever
confidences a proposal reports. Both are this rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ConfidenceRule:
    floor: float = 0.0  # 0: every draft is verified

    def keeps(self, confidence: float) -> bool:
        """Whether a draft the drafter is this sure of is verified (and a chain goes on past it)."""
        return self.floor <= 0 or confidence >= self.floor

    def verified(self, confidences: Sequence[float]) -> int:
        """How many leading drafts of these confidences are verified."""
        for j, confidence in enumerate(confidences):
            if not self.keeps(confidence):
                return j
        return len(confidences)


EVERY_DRAFT = ConfidenceRule()


def count_chain(reached: list[float], kept_at: list[float], kept: int, proposed: int, weight: float = 1.0) -> None:
    """Count one chain in per-position tallies (index j is draft position j; 0 is unused): the
    positions it reached, and whether it kept each. Positions past the tallies are not counted."""
    top = len(reached) - 1
    for j in range(1, min(kept, top) + 1):
        reached[j] += weight
        kept_at[j] += weight
    if kept < min(proposed, top):
        reached[kept + 1] += weight


def keep_ratios(reached: Sequence[float], kept: Sequence[float], prior: float, positions: int) -> list[float]:
    """The chance that a chain which reached draft position j keeps its draft there, for j = 1 ..
    positions (index 0 holds 1): the tallies' ratio, with `prior` chains believed as likely kept as
    at the position before (at the first, half the time); past the tallies, the prior alone."""
    ratios, previous = [1.0], 0.5
    for j in range(1, positions + 1):
        seen, hit = (reached[j], kept[j]) if j < len(reached) else (0.0, 0.0)
        previous = (hit + prior * previous) / (seen + prior)
        ratios.append(previous)
    return ratios
