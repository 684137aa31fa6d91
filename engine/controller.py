"""The controller: owns the policy and decides which runtime state each round runs with.

Modes:
- adaptive: the policy picks k after every verified round;
- pinned(k): k is held; the policy keeps observing, its decisions are not applied;
- forced(k): k is used from the next boundary, then the policy adapts again from there;
- static: adaptation is disabled in the config; k is fixed.

Control messages (new parameters, pin, unpin, force) are applied with `apply` between rounds, on
the engine thread (engine/loop.py queues them from other threads); each is acknowledged with the
round from which it takes effect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from engine.confidence import EVERY_DRAFT, ConfidenceRule
from engine.core import Engine, StepResult
from engine.policy import Observation, Policy, PolicyParams, RoundProfile, make_policy
from engine.policy.threads import ThreadPolicy

log = structlog.get_logger("adaspec.engine")
# The same name in the standard library's tree, whose level follows the daemon's (control/logs.py).
levels = logging.getLogger("adaspec.engine")


@dataclass(frozen=True)
class Ack:
    round: int  # the first round run under the change
    k: int
    mode: str


@dataclass(frozen=True)
class SetParams:
    params: PolicyParams
    adaptive: bool = True
    static_k: int | None = None


FORCE_NEEDS_ADAPTING = "adaptation is disabled: force needs [adaptive] enabled = true (use pin)"


@dataclass(frozen=True)
class Pin:
    k: int


@dataclass(frozen=True)
class Unpin:
    pass


@dataclass(frozen=True)
class Force:
    k: int


Message = SetParams | Pin | Unpin | Force
SwitchObserver = Callable[[int, int, str], None]  # (from k, to k, reason)


# Why k changed when an operator changed it: admin commands and config reloads.
OPERATOR_REASONS = frozenset({"pin", "unpin", "force", "params"})


class Controller:
    def __init__(
        self,
        engine: Engine,
        params: PolicyParams,
        adaptive: bool = True,
        static_k: int | None = None,
        initial_k: int | None = None,
        on_switch: SwitchObserver | None = None,
        threads: ThreadPolicy | None = None,
    ) -> None:
        self.engine = engine
        # How many threads the compiled CPU forward runs each round on (None: left as it is).
        self.threads = threads
        self.on_switch = on_switch  # called on the engine thread after every switch (metrics)
        self.params = params
        # What each state's rounds cost where the engine timed them before serving (time_rounds).
        self.profile: RoundProfile = engine.profile
        self.policy: Policy = make_policy(params, initial_k, self.profile)
        self.mode = "adaptive" if adaptive else "static"
        self.static_k = static_k if static_k is not None else self.policy.k
        self.pinned: int | None = None
        self.forced: int | None = None  # k for the next round only
        self.switches = 0
        self._k = self._wanted_k()
        self._reason = "start"
        self._require_state(self._k)

    # ---- what the next round uses --------------------------------------------------------

    @property
    def k(self) -> int:
        return self._k

    def _wanted_k(self) -> int:
        # An operator's pin holds over the config's static k too, until unpinned.
        if self.pinned is not None:
            return self.pinned
        if self.mode == "static":
            return self.static_k
        if self.forced is not None:
            return self.forced
        return self.policy.k

    def _require_state(self, k: int) -> None:
        if k not in self.engine.states:
            raise ValueError(f"no runtime state for draft length {k}; built: {sorted(self.engine.states)}")

    # ---- control messages (between rounds) -------------------------------------------------

    def apply(self, message: Message) -> Ack:
        """Apply a control message before the next round; ValueError or KeyError (and nothing
        changed) if it cannot be."""
        reason = self._apply(message)
        self._set_k(self._wanted_k(), reason)
        return self.ack()

    def ack(self) -> Ack:
        """What the next round runs with."""
        return Ack(self.engine.round, self._k, self.mode_name)

    def _apply(self, message: Message) -> str:
        match message:
            case Pin(k):
                self._require_state(k)
                # A force not yet run is overridden: unpin resumes adapting from the pinned k.
                self.pinned, self.forced = k, None
                return "pin"
            case Unpin():
                if self.pinned is not None:
                    self.policy.set_k(self.pinned)
                self.pinned = None
                return "unpin"
            case Force(k):
                self._require_state(k)
                if self.mode == "static":
                    raise ValueError(FORCE_NEEDS_ADAPTING)
                self.pinned, self.forced = None, k
                # The policy adapts from the forced k (snapped onto its candidates) afterwards.
                self.policy.set_k(k)
                return "force"
            case SetParams(params, adaptive, static_k):
                for k in params.all_k:
                    self._require_state(k)
                if static_k is not None:
                    self._require_state(static_k)
                if params.strategy != self.params.strategy or bool(params.slots) != bool(self.params.slots):
                    # Another strategy learns other things: it starts afresh from the current k.
                    self.policy = make_policy(params, self.policy.k, self.profile)
                else:
                    self.policy.update_params(params)
                self.params = params
                self.mode = "adaptive" if adaptive else "static"
                if static_k is not None:
                    self.static_k = static_k
                return "params"

    @property
    def mode_name(self) -> str:
        if self.pinned is not None:
            return "pinned"
        if self.forced is not None:
            return "forced"
        return self.mode

    # ---- the loop body ------------------------------------------------------------------

    def _set_k(self, k: int, reason: str) -> None:
        if k == self._k:
            return
        # The policy switches many times a second while it explores: its own switches are debug
        # events (their counts are in the metrics), built only when debug is on (an event dropped
        # by the level still costs 30 us a switch); an operator's pin, force or reload is info.
        operator = reason in OPERATOR_REASONS
        if operator or levels.isEnabledFor(logging.DEBUG):
            emit = log.info if operator else log.debug
            ema = self.policy.ema  # only the ema strategy keeps one
            held = {} if ema is None else {"ema": round(ema, 4)}
            emit("switch", **{"from": self._k, "to": k}, **held, reason=reason, round=self.engine.round)
        previous, self._k = self._k, k
        self.switches += 1
        if self.on_switch is not None:
            self.on_switch(previous, k, reason)

    @property
    def rule(self) -> ConfidenceRule:
        """Which drafts the next round verifies: a pinned, forced or static k verifies exactly k;
        the policy's rounds verify those the drafter is at least `draft_confidence` sure of."""
        return ConfidenceRule(self.params.draft_confidence) if self.mode_name == "adaptive" else EVERY_DRAFT

    def step(self) -> StepResult:
        """Run one round with the k, the rule and the thread count decided here."""
        threads = self.threads
        if threads is not None and threads.threads != torch.get_num_threads():
            torch.set_num_threads(threads.threads)
        k, row_ks = self._k, None
        if self.params.per_sequence and self.mode_name == "adaptive":
            row_ks = self.policy.row_ks([seq.request.id for seq in self.engine.running])
            if row_ks:
                # The state verifies chains up to its k: the least built one that holds every row's.
                longest = max(row_ks.values())
                k = min((s for s in self.engine.states if s >= longest), default=k)
        started = time.perf_counter()
        result = self.engine.step(k, self.rule, row_ks)
        round_seconds = time.perf_counter() - started - result.prefill_seconds
        verified = [o for o in result.outputs if o.verified]
        if threads is not None and verified:
            tried = threads.trying
            if threads.observe(result.k, result.batch_size, round_seconds):
                # Every k costs something else on another count: the policy prices them afresh,
                # from the k it serves (the timed profile, scaled to the live rounds).
                log.info("threads", threads=threads.threads, round=self.engine.round)
                self.policy = make_policy(self.params, self.policy.k, self.profile)
            if tried:
                verified = []  # a round on a count tried says nothing of what k's cost when served
        if verified:
            decision = self.policy.observe(
                Observation(
                    k=result.k,
                    accepted=tuple(o.drafts_accepted for o in verified),
                    proposed=tuple(o.drafts_proposed for o in verified),
                    draft_seconds=result.draft_seconds,
                    verify_seconds=result.verify_seconds,
                    round_seconds=round_seconds,
                    ids=tuple(o.request_id for o in verified),
                )
            )
        else:
            decision = None
        if self.forced is not None and result.batch_size:
            self.forced = None  # the forced round has run: adapt again from here
            self._set_k(self._wanted_k(), decision.reason if decision else "policy")
        elif decision is not None and self.mode == "adaptive" and self.pinned is None:
            self._set_k(decision.k, decision.reason)
        return result
