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

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)
