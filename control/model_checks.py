"""Whether the checkpoints a configuration names are in place, read without loading any weights."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from control.issues import ConfigIssue
from engine.gguf import GGUFCheckpoint, is_gguf
from engine.model.config import (
    DFLASH_KINDS,
    DRAFT_MODEL_KINDS,
    EAGLE3_KINDS,
    CheckpointError,
    ModelConfig,
    inspect_checkpoint,
    split_problem,
    tokenizer_vocabulary,
)


def model_issues(values: Mapping[str, Any]) -> list[ConfigIssue]:
    """Whether the target, and the draft where the drafter runs one, are checkpoints: directories
    (config.json of a supported architecture, weights, tokenizer.json) or GGUF files (a supported
    architecture, tensor types and tokenizer); and the draft shares the target's tokenizer. Read
    without loading any weights."""
    issues: list[ConfigIssue] = []
    found: dict[str, tuple[Path, ModelConfig, Callable[[], dict[str, int] | None]]] = {}
    names = ["engine.target"]
    if values.get("engine.drafter") in DRAFT_MODEL_KINDS:
        names.append("engine.draft")
    for name in names:
        if values.get(name) is None:
            continue  # invalid itself: already reported
        try:
            found[name] = (values[name], *_inspect(values[name]))
        except CheckpointError as err:
            issues.append(ConfigIssue(name, str(err)))
    # The drafters fed the target's hidden states: their checkpoint, checked against the target,
    # the weights by their file's header.
    for kinds, name in ((DFLASH_KINDS, "engine.dflash"), (EAGLE3_KINDS, "engine.eagle3")):
        path = values.get(name)
        if values.get("engine.drafter") in kinds and "engine.target" in found and path is not None:
            try:
                _inspect_drafter(name, path, found["engine.target"][1])
            except CheckpointError as err:
                issues.append(ConfigIssue(name, str(err)))
    ranks = values.get("engine.tensor_parallel") or 1
    problem = split_problem(found["engine.target"][1], ranks) if "engine.target" in found and ranks > 1 else None
    if problem:
        issues.append(ConfigIssue("engine.tensor_parallel", f"{problem} (the target {values['engine.target']})"))
    if len(found) == 2:
        (_, target_config, target_vocabulary), (draft, draft_config, draft_vocabulary) = found.values()
        same_vocabulary = draft_vocabulary() == target_vocabulary()
        if draft_config.vocab_size != target_config.vocab_size or not same_vocabulary:
            issues.append(
                ConfigIssue(
                    "engine.draft",
                    f"{draft} does not share the target's tokenizer (vocabulary of {draft_config.vocab_size}, "
                    f'the target {target_config.vocab_size}): pick a draft of the same family, or drafter = "ngram"',
                )
            )
    return issues


def _inspect(path: Path) -> tuple[ModelConfig, Callable[[], dict[str, int] | None]]:
    """A checkpoint's config, and how to read its tokenizer's vocabulary: of a directory, or of
    a GGUF file (kept open, as reading its metadata is seconds for a large vocabulary)."""
    if is_gguf(path):
        checkpoint = GGUFCheckpoint(path)
        return checkpoint.check(), checkpoint.vocabulary
    return inspect_checkpoint(path), lambda: tokenizer_vocabulary(path)


def _inspect_drafter(name: str, path: Path, target: ModelConfig) -> None:
    """The feature drafter `name` configures, checked against the target by its config and its
    weights' header. Its module (which needs torch) is imported only where one is configured, so
    a check of any other config stays quick."""
    if name == "engine.dflash":
        from engine.model.dflash import inspect_dflash_weights as inspect
    else:
        from engine.model.eagle3 import inspect_eagle3_weights as inspect
    inspect(path, target)
