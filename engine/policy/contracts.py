"""What the engine and the policies exchange: rounds observed and decisions."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from engine.policy.params import PolicyParams

# (k, batch size) -> the seconds of a round, timed by the engine before serving
# (Engine.time_rounds): what each k costs before a policy has served it.
RoundProfile = Mapping[tuple[int, int], float]


@dataclass(frozen=True)
class Observation:
    """One verified round, as a policy sees it."""

    k: int
    accepted: tuple[int, ...]  # accepted drafts of each request in the round
    proposed: tuple[int, ...]  # drafts proposed to each request (k, or fewer near max_tokens)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # The whole round's wall time, emitting included (not admitting new requests); 0 when unknown.
    round_seconds: float = 0.0
    ids: tuple[str, ...] = ()  # each row's request id, where a policy keeps counts per sequence

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


@dataclass(frozen=True)
class Decision:
    k: int
    reason: str  # "up", "down", "probe", "measured", "batch", "slot"


class Policy(Protocol):
    params: PolicyParams
    candidates: list[int]  # the draft lengths it chooses from now (a slotted policy's: its slot's)

    @property
    def k(self) -> int: ...

    @property
    def serving(self) -> int:
        """The k served between tries of others: where it differs from `k`, the next round is a try."""
        ...

    @property
    def ema(self) -> float | None:
        """The acceptance EMA where the strategy keeps one (ema); None where it keeps none."""
        ...

    def observe(self, observation: Observation) -> Decision | None: ...

    def row_ks(self, ids: Seq[str]) -> Mapping[str, int] | None:
        """Each running sequence's own k for the next round, or None: every one drafts `k`."""
        ...

    def set_k(self, k: int) -> None: ...

    def update_params(self, params: PolicyParams) -> None: ...


def snap(k: int, candidates: Seq[int]) -> int:
    """The candidate nearest to k; ties go to the larger."""
    return min(sorted(candidates), key=lambda c: (abs(c - k), -c))
