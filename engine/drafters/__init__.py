"""Drafters: they propose up to k tokens per sequence, and forget the ones the target rejects
(the protocol: engine/drafters/base.py)."""

from __future__ import annotations

from engine.checkpoint import Checkpoint
from engine.drafters.base import Drafter
from engine.drafters.draft_model import DraftModelDrafter, HybridDrafter
from engine.drafters.ngram import NgramDrafter


def make_drafter(
    kind: str,
    draft: Checkpoint | None,
    max_batch_size: int,
    max_seq_len: int,
    quantize: bool = True,
    ngram_min: int = 1,
    ngram_max: int = 4,
    lookup_history: int = 0,
) -> Drafter | None:
    """The drafter `kind` names ("draft_model", "hybrid", "ngram" or "none"), as [engine] sets it up."""
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(ngram_min, ngram_max, lookup_history)
    if draft is None:
        raise ValueError(f"drafter {kind!r} needs a draft model")
    if kind == "draft_model":
        return DraftModelDrafter(draft, max_batch_size, max_seq_len, quantize)
    if kind == "hybrid":
        return HybridDrafter(
            draft, max_batch_size, max_seq_len, quantize, min_n=ngram_min, max_n=ngram_max, history=lookup_history
        )
    raise ValueError(f"unknown drafter {kind!r}: expected draft_model, hybrid, ngram or none")
