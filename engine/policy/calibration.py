"""How often drafts are kept: by the drafter's confidence, and for lookups by match length."""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field


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
