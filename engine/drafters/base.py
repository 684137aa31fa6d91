"""The drafter protocol and what a drafter proposes.

Every drafter follows the same protocol, so the engine never asks which one it holds:

- `admit(seqs, hidden)`: new sequences joined (their prompts are in `seq.tokens`; `hidden` holds
  the prefill's hidden states at `capture_layers`, a row per sequence);
- `propose(seqs, ks, rule)`: up to `ks[i]` draft tokens for sequence i, with the drafter's
  probabilities for each (None means the proposal is deterministic: a one-hot distribution) and,
  where it knows them before the target looks, its confidence in each; a drafter that drafts a
  step at a time may stop a chain where `rule` would cut it, sparing the steps after it;
- `accept(seqs, accepted, hidden)`: after verification, `accepted[i]` drafts of sequence i were
  kept and `seq.tokens` already holds them plus the target's token; roll back the rest;
- `release(seq)`: the sequence left;
- `capture(k, backend, batch_sizes)`: graphs a runtime state of draft length k needs, on a
  backend that has graphs; `timing()`: how it drafts while the engine times rounds.

`capture_layers` names the target layers whose hidden states the drafter reads from the last
verify (EAGLE- and DFlash-style drafters); the draft-model and n-gram drafters need none.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from engine.confidence import ConfidenceRule
from engine.device.backend import Backend
from engine.request import Sequence


@dataclass
class Proposal:
    tokens: list[int]
    probs: Tensor | None = None  # [len(tokens), V] the drafter's distribution, or None if one-hot
    # The drafter's confidence in each draft, where it knows it before the target looks; what the
    # round's ConfidenceRule cuts by (engine/confidence.py says what it means).
    confidence: list[float] | None = None
    trimmed: int = 0  # drafts left out because the drafter was unsure of them

    def cut(self, rule: ConfidenceRule) -> None:
        """Only the drafts before the first one `rule` does not keep are verified. Lossless
        whatever it cuts, since it is decided before the target sees any of them."""
        if self.confidence is None:
            return
        count = rule.verified(self.confidence)
        self.trimmed += len(self.tokens) - count
        self.tokens, self.confidence = self.tokens[:count], self.confidence[:count]
        if self.probs is not None:
            self.probs = self.probs[:count]


class Drafter(Protocol):
    """What every drafter does (this module's docstring); the defaults suit a drafter with no
    graphs and nothing to set aside while rounds are timed."""

    name: str
    capture_layers: tuple[int, ...]
    # Set by the engine from its backend: draw sampled drafts a batch at a time with device
    # operators (engine/sampling.py `RowSampling`) rather than a row and a read back at a time.
    samples_on_device: bool = False

    def admit(self, seqs: Seq[Sequence], hidden: dict[int, Tensor]) -> None: ...

    def propose(self, seqs: Seq[Sequence], ks: Seq[int], rule: ConfidenceRule) -> list[Proposal]: ...

    def accept(self, seqs: Seq[Sequence], accepted: Seq[int], hidden: dict[int, Tensor]) -> None: ...

    def release(self, seq: Sequence) -> None: ...

    def capture(self, k: int, backend: Backend, batch_sizes: Seq[int]) -> int:
        """Capture what the runtime state of draft length `k` needs (and what every state shares,
        if no state has yet); returns the memory it added."""
        return 0

    @property
    def graph_captures(self) -> int:
        """Graphs captured so far."""
        return 0

    def timing(self) -> AbstractContextManager[None]:
        """Held while the engine times rounds before serving (engine/core.py `time_rounds`)."""
        return nullcontext()
