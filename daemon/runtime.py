"""Turning the [engine] and [adaptive] sections of a config snapshot into a running engine."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace

from control.config import ConfigSnapshot
from engine.checkpoint import Checkpoint, load_checkpoint
from engine.controller import Controller, SwitchObserver
from engine.core import Engine
from engine.drafters import DRAFT_MODEL_KINDS, Drafter, DraftModelDrafter, make_drafter
from engine.loop import EngineLoop, StepObserver


def required_steps(snapshot: ConfigSnapshot) -> tuple[int, ...]:
    """Every k the adaptive section may ask for: each needs a runtime state before it is used."""
    adaptive = snapshot.adaptive
    steps = set(adaptive.policy.all_steps)
    steps.add(adaptive.static_steps)
    if snapshot.engine.drafter == "none":
        return (0,)
    return tuple(sorted(steps))


def build_drafter(snapshot: ConfigSnapshot, progress: Callable[[str], None]) -> Drafter | None:
    engine = snapshot.engine
    draft = None
    if engine.drafter in DRAFT_MODEL_KINDS:
        progress(f"loading draft {engine.draft}")
        draft = load_checkpoint(engine.draft, engine.device, None if engine.dtype == "auto" else engine.dtype)
    return make_drafter(
        engine.drafter,
        draft,
        engine.max_batch_size,
        engine.max_seq_len,
        quantize=engine.draft_quantization == "int8",
        ngram_min=engine.ngram_min,
        ngram_max=engine.ngram_max,
        lookup_history=engine.lookup_history,
    )


def build_engine(
    snapshot: ConfigSnapshot,
    progress: Callable[[str], None] = lambda _: None,
    *,
    on_step: StepObserver | None = None,
    on_switch: SwitchObserver | None = None,
) -> EngineLoop:
    """Load the models and build every runtime state the config names (slow: run in a thread).

    `on_step` and `on_switch` observe every round and every change of k, on the engine thread."""
    settings = snapshot.engine
    progress(f"loading target {settings.target}")
    target: Checkpoint = load_checkpoint(
        settings.target, settings.device, None if settings.dtype == "auto" else settings.dtype
    )
    drafter = build_drafter(snapshot, progress)
    if drafter is not None and isinstance(drafter, DraftModelDrafter):
        if drafter.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft {settings.draft} has a vocabulary of {drafter.model.config.vocab_size}, "
                f"the target {target.config.vocab_size}: they must share a tokenizer"
            )
    steps = required_steps(snapshot)
    progress(f"building runtime states for k in {list(steps)}")
    engine = Engine(
        target,
        drafter,
        settings.max_batch_size,
        settings.max_seq_len,
        steps,
        max_steps=settings.max_steps,
        verification=settings.verification,
    )
    adaptive = snapshot.adaptive
    if drafter is None:
        plain = replace(adaptive.policy, candidate_steps=(0,), slots=())
        controller = Controller(engine, plain, adaptive=False, static_steps=0, on_switch=on_switch)
    else:
        controller = Controller(
            engine,
            adaptive.policy,
            adaptive=adaptive.enabled,
            static_steps=adaptive.static_steps,
            initial_steps=adaptive.initial_steps,
            on_switch=on_switch,
        )
    # Start-up made millions of objects (torch, the models) that live as long as the process; the
    # collector would walk them again and again, a few percent of every round's time.
    gc.freeze()
    return EngineLoop(controller, on_step=on_step)
