"""A request and the engine's state for it while it runs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from engine.detokenize import OutputText
from engine.sampling import SamplingParams

_ids = itertools.count()


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")


def finish_reason(
    tokens: Seq[int], params: SamplingParams, eos_ids: frozenset[int], text: OutputText | None
) -> str | None:
    """Why a sequence whose output so far is `tokens` (as text: `text`, where it has stop
    strings) must end, or None."""
    if tokens and not params.ignore_eos and tokens[-1] in eos_ids:
        return "stop"
    if text is not None and text.stopped:
        return "stop"
    if len(tokens) >= params.max_tokens:
        return "length"
    return None


@dataclass(eq=False)
class Sequence:
    """A running request. `tokens` is prompt + output; the target cache always holds all of them
    but the last, which is fed at the start of the next round."""

    request: Request
    slot: int
    generator: torch.Generator | None
    tokens: list[int]
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: OutputText | None = None  # the output as text, kept where there are stop strings to find
    draft_slot: int | None = None  # the drafter's own cache slot, if it has one
    # Drafts kept and judged in recent rounds, as sums that fade by `acceptance_decay` a round.
    # A new sequence starts from one judged draft, kept as often as the prior says.
    kept_recently: float = 0.5
    judged_recently: float = 1.0
    acceptance_decay = 0.7
    # Tokens emitted over rounds run, as sums that fade more slowly (a round's count swings from
    # one to the whole chain): how fast the sequence gets through its output. A new sequence
    # starts from one round at the prior pace.
    emitted_recently: float = 1.0
    rounds_recently: float = 1.0
    pace_decay = 0.9

    @property
    def acceptance(self) -> float:
        """Share of its recently judged drafts the target kept: a sequence that is copying a
        pattern keeps nearly all of them even where the drafter sounds unsure (see
        policy.Calibration)."""
        return self.kept_recently / self.judged_recently

    @property
    def pace(self) -> float:
        """Tokens it recently emitted per round (kept drafts and the target's own): a sequence
        that moves slowly holds its batch slot longer, so each token it gains is worth more
        (policy.GoodputPolicy prices its drafts by it)."""
        return self.emitted_recently / self.rounds_recently

    def record_acceptance(self, proposed: int, kept: int) -> None:
        self.emitted_recently = self.pace_decay * self.emitted_recently + kept + 1
        self.rounds_recently = self.pace_decay * self.rounds_recently + 1
        # Drafts after the first rejected one were never judged. Kept over judged summed across
        # rounds, not a mean of each round's share: a round's share is biased low (drafts kept
        # at rate 0.69 give rounds of three drafts a mean share of 0.53).
        judged = min(proposed, kept + 1)
        if judged:
            self.kept_recently = self.acceptance_decay * self.kept_recently + kept
            self.judged_recently = self.acceptance_decay * self.judged_recently + judged

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)
