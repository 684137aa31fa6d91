"""Turning the [engine] and [adaptive] sections of a config snapshot into a running engine: the one
way an engine is assembled, by the daemon, the benches and the tools alike."""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch

from control.settings import EngineSettings
from control.snapshot import ConfigSnapshot
from engine import parallel
from engine.checkpoint import Checkpoint, load_checkpoint
from engine.controller import Controller, SwitchObserver
from engine.core import Engine
from engine.device.backend import backend_for
from engine.device.graphs import default_batch_sizes
from engine.device.prefill import eager_prefill
from engine.drafters import make_drafter
from engine.drafters.base import Drafter
from engine.drafters.dflash import DFlashDrafter, HybridDFlashDrafter
from engine.drafters.eagle3 import Eagle3Drafter, HybridEagle3Drafter
from engine.loop import EngineLoop, StepObserver
from engine.model.config import DFLASH_KINDS, DRAFT_MODEL_KINDS, EAGLE3_KINDS
from engine.model.dflash import DFlashModel, load_dflash
from engine.model.eagle3 import Eagle3Model, load_eagle3
from engine.native.build import library, pending_build
from engine.policy.threads import ThreadPolicy, usable_cores

# Wraps each slow phase of assembling an engine, named, so that start-up can report it.
Phase = Callable[[str], AbstractContextManager[object]]


def unreported(name: str) -> AbstractContextManager[object]:
    return nullcontext()


@dataclass(frozen=True)
class Models:
    """The checkpoints a config names, loaded once: engines built from them share the weights."""

    target: Checkpoint
    draft: Checkpoint | None  # for the drafters that run a draft model
    dflash: DFlashModel | None = None  # for the dflash drafters
    eagle3: Eagle3Model | None = None  # for the eagle3 drafter


def required_k(snapshot: ConfigSnapshot) -> tuple[int, ...]:
    """Every k the adaptive section may ask for: each needs a runtime state before it is used."""
    adaptive = snapshot.adaptive
    ks = set(adaptive.policy.all_k)
    ks.add(adaptive.static_k)
    if snapshot.engine.drafter == "none":
        return (0,)
    return tuple(sorted(ks))


def load_models(snapshot: ConfigSnapshot, phase: Phase = unreported, kinds: Collection[str] = ()) -> Models:
    """The checkpoints the config's drafter needs, and those `kinds` of drafter need too (benches
    that compare drafters)."""
    settings = snapshot.engine
    kinds = {settings.drafter, *kinds}
    build = pending_build() if settings.device == "cpu" else None
    if build is not None:  # a first start on this machine: seconds of compiling, said as such
        with phase(f"compile the CPU kernels: {build}"):
            library()
    if settings.tensor_parallel > 1:
        with phase(f"start ranks 1..{settings.tensor_parallel - 1} and load target {settings.target} on each"):
            target = sharded_target(settings)
    else:
        with phase(f"load target {settings.target}"):
            target = load_checkpoint(settings.target, settings.device, settings.dtype, weights=settings.weights)
    draft = None
    if kinds & set(DRAFT_MODEL_KINDS):
        with phase(f"load draft {settings.draft}"):
            draft = load_checkpoint(settings.draft, settings.device, settings.dtype)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft {settings.draft} has a vocabulary of {draft.config.vocab_size}, "
                f"the target {target.config.vocab_size}: they must share a tokenizer"
            )
    dflash = None
    if kinds & set(DFLASH_KINDS) and settings.dflash is not None:
        with phase(f"load dflash {settings.dflash}"):
            dflash = load_dflash(settings.dflash, target.model)
    eagle3 = None
    if kinds & set(EAGLE3_KINDS) and settings.eagle3 is not None:
        with phase(f"load eagle3 {settings.eagle3}"):
            eagle3 = load_eagle3(settings.eagle3, target.model)
    return Models(target, draft, dflash, eagle3)


def sharded_target(settings: EngineSettings) -> Checkpoint:
    """Rank 0's share of the target, the other ranks started (engine/parallel.py) and joined."""
    world = settings.tensor_parallel
    dtype = None if settings.dtype == "auto" else settings.dtype
    address = parallel.spawn(world, str(settings.target), settings.device, dtype, settings.weights)
    parallel.init(0, world, address, torch.device(settings.device))
    target = load_checkpoint(
        settings.target, settings.device, settings.dtype, native_forward=False, weights=settings.weights
    )
    parallel.shard(target.model, 0, world)
    return target


def lookups(settings: EngineSettings) -> dict[str, int]:
    """The prompt-lookup settings of a hybrid drafter (`LookupFirst`)."""
    return {"min_n": settings.ngram_min, "max_n": settings.ngram_max, "history": settings.lookup_history}


def build_drafter(settings: EngineSettings, models: Models, batch: int, seq_len: int) -> Drafter | None:
    """The drafter [engine] names, on the loaded models; None for drafter = "none"."""
    quantize = settings.draft_quantization == "int8"
    if settings.drafter in DFLASH_KINDS:
        if models.dflash is None:
            raise ValueError(
                f"drafter {settings.drafter} needs a DFlash checkpoint (engine.dflash = {settings.dflash})"
            )
        if settings.drafter == "dflash":
            return DFlashDrafter(models.dflash, models.target.model, batch, seq_len, quantize)
        return HybridDFlashDrafter(models.dflash, models.target.model, batch, seq_len, quantize, **lookups(settings))
    if settings.drafter in EAGLE3_KINDS:
        if models.eagle3 is None:
            raise ValueError(f"drafter {settings.drafter} needs an EAGLE-3 head (engine.eagle3 = {settings.eagle3})")
        if settings.drafter == "eagle3":
            return Eagle3Drafter(models.eagle3, models.target.model, batch, seq_len, quantize)
        return HybridEagle3Drafter(models.eagle3, models.target.model, batch, seq_len, quantize, **lookups(settings))
    return make_drafter(
        settings.drafter,
        models.draft,
        batch,
        seq_len,
        quantize=quantize,
        ngram_min=settings.ngram_min,
        ngram_max=settings.ngram_max,
        lookup_history=settings.lookup_history,
    )


def build_controller(
    snapshot: ConfigSnapshot,
    models: Models,
    *,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
    on_switch: SwitchObserver | None = None,
    phase: Phase = unreported,
) -> Controller:
    """An engine and its controller as the snapshot describes them, every runtime state built
    (`max_batch_size` and `max_seq_len` override the config's, for benches)."""
    settings = snapshot.engine
    batch = max_batch_size or settings.max_batch_size
    seq_len = max_seq_len or settings.max_seq_len
    drafter = build_drafter(settings, models, batch, seq_len)
    if settings.tensor_parallel > 1:  # the other ranks allocate their share of the engine's cache
        parallel.Leader.of(models.target.model).start(batch, seq_len)
    first, *others = required_k(snapshot)
    backend = backend_for(models.target.model.device)
    # A sharded target's forwards reach the other ranks through its forward hook (engine/parallel.py
    # `Leader`); a replayed graph would run on rank 0 alone.
    graphs = settings.tensor_parallel == 1
    most = settings.prefill_graph_tokens
    why = eager_prefill(backend, most, None if graphs else "a target split across ranks runs no graphs")
    prefill = f"prefill eagerly: {why}" if why else f"capture prefill graphs up to {most} tokens"
    with phase(f"allocate caches, {prefill}, build runtime state k={first}"):
        engine = Engine(
            models.target,
            drafter,
            batch,
            seq_len,
            [first],
            max_k=settings.max_k,
            backend=backend,
            graphs=graphs,
            verification=settings.verification,
            prefill_graph_tokens=settings.prefill_graph_tokens,
        )
    for k in others:
        with phase(f"build runtime state k={k}"):
            engine.build_state(k)
    adaptive = snapshot.adaptive
    if drafter is None:
        plain = replace(adaptive.policy, candidate_k=(0,), slots=())
        threads = thread_policy(engine, settings.threads)
        return Controller(engine, plain, adaptive=False, static_k=0, on_switch=on_switch, threads=threads)
    if engine.model.device.type == "cpu":  # as thread_policy decides: time the rounds on the count served first
        torch.set_num_threads(settings.threads or usable_cores())
    if len(engine.states) > 1:
        # What each k costs at each batch size, so that a policy need not serve a k to price it.
        sizes = default_batch_sizes(batch)
        for size in sizes:  # a phase each: under a busy neighbour the whole can take a minute
            with phase(f"time the rounds of k={sorted(engine.states)} at batch size {size} (of {sizes})"):
                engine.time_rounds([size])
    return Controller(
        engine,
        adaptive.policy,
        adaptive=adaptive.enabled,
        static_k=adaptive.static_k,
        initial_k=adaptive.initial_k,
        on_switch=on_switch,
        threads=thread_policy(engine, settings.threads),
    )


def thread_policy(engine: Engine, pinned: int) -> ThreadPolicy | None:
    """On a CPU, the threads each round runs on: `pinned`, or adapted up to every usable core,
    each k's rounds in the units of their timing before serving; elsewhere the host's threads only
    launch work, and are left as they are."""
    if engine.model.device.type != "cpu":
        return None
    return ThreadPolicy(usable_cores(), pinned=pinned or None, profile=engine.profile)


def build_engine(
    snapshot: ConfigSnapshot,
    phase: Phase = unreported,
    *,
    on_step: StepObserver | None = None,
    on_switch: SwitchObserver | None = None,
) -> EngineLoop:
    """Load the models and build every runtime state the config names (slow: run in a thread).

    `on_step` and `on_switch` observe every round and every change of k, on the engine thread."""
    models = load_models(snapshot, phase)
    controller = build_controller(snapshot, models, on_switch=on_switch, phase=phase)
    return EngineLoop(controller, on_step=on_step)
