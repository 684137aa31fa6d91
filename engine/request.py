"""A request and the engine's state for it while it runs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from engine.sampling import SamplingParams

_ids = itertools.count()


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")


def finish_reason(tokens: Seq[int], params: SamplingParams, eos_ids: frozenset[int], text: str | None) -> str | None:
    """Why a sequence whose output so far is `tokens` (decoded: `text`) must end, or None."""
    if tokens and not params.ignore_eos and tokens[-1] in eos_ids:
        return "stop"
    if text is not None and any(stop in text for stop in params.stop):
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
    draft_slot: int | None = None  # the drafter's own cache slot, if it has one
    # Share of its recently judged drafts the target kept: a sequence that is copying a pattern
    # keeps nearly all of them even where the drafter sounds unsure (see policy.Calibration).
    acceptance: float = 0.5

    def record_acceptance(self, proposed: int, kept: int) -> None:
        # Drafts after the first rejected one were never judged.
        judged = min(proposed, kept + 1)
        if judged:
            self.acceptance += 0.3 * (kept / judged - self.acceptance)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)
