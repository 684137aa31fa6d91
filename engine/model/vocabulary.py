"""A feature drafter's own vocabulary: a subset of the target's, mapped back by `d2t`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from engine.model.config import CheckpointError


class DraftVocabulary:
    """A feature drafter's own vocabulary, a subset of the target's where the checkpoint has
    `d2t` (draft id d is target id d + d2t[d], as SpecForge writes it): a head over the frequent
    ids costs a fraction of one over the whole vocabulary. Mixed into the drafters' nn.Modules."""

    config: Any  # with vocab_size and draft_vocab_size
    fc: nn.Linear
    d2t: Tensor

    def draft_to_target(self) -> Tensor:
        ids = torch.arange(self.config.draft_vocab_size, device=self.fc.weight.device)
        return ids + self.d2t if self.config.draft_vocab_size < self.config.vocab_size else ids

    @staticmethod
    def check_map(source: Path, state: dict[str, Tensor], draft_vocab_size: int, vocab_size: int) -> None:
        """A checkpoint's d2t (in `state`, read from `source`): every draft id maps into the target's vocabulary."""
        if "d2t" in state:
            ids = torch.arange(draft_vocab_size) + state["d2t"].long()
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise CheckpointError(f"{source}: d2t maps draft ids outside the vocabulary (0..{vocab_size - 1})")

    def full_vocabulary(self, logits: Tensor) -> Tensor:
        """Draft-vocabulary logits placed in the target's vocabulary, the ids outside at -inf."""
        if logits.shape[-1] == self.config.vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.draft_to_target(), logits)

    def full_probabilities(self, probs: Tensor, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary probabilities placed in the target's vocabulary (`draft_ids`, the
        drafter's `draft_to_target()`), where the rejection rule reads them; zero outside. A
        draft is drawn over the draft vocabulary, a quarter of the target's or less."""
        if probs.shape[-1] == self.config.vocab_size:
            return probs
        return probs.new_zeros((*probs.shape[:-1], self.config.vocab_size)).index_copy_(-1, draft_ids, probs)
