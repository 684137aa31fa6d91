"""What the engine, the drafters and the policies exchange: rounds observed, decisions, the
chains a draft cutoff weighs, and the verify curve."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from engine.policy.params import PolicyParams


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
    def tokens(self) -> int:
        """Tokens the round emitted: each request's accepted drafts and the target's own token."""
        return sum(self.accepted) + self.batch_size

    @property
    def seconds(self) -> float:
        """The round's wall time, or its draft and verify time where that is not known."""
        return self.round_seconds or self.draft_seconds + self.verify_seconds

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
