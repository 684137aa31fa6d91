"""A policy per batch-size range."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import replace

from engine.policy.contracts import Decision, Observation, Policy, RoundProfile
from engine.policy.ema import EmaPolicy
from engine.policy.measured import MeasuredPolicy
from engine.policy.params import PolicyParams
from engine.policy.positional import PositionalPolicy

STRATEGIES: dict[str, type[EmaPolicy] | type[MeasuredPolicy] | type[PositionalPolicy]] = {
    "ema": EmaPolicy,
    "measured": MeasuredPolicy,
    "positional": PositionalPolicy,
}


class SlottedPolicy:
    """One inner policy per batch-size slot; the slot is the largest min_batch_size <= batch."""

    def __init__(self, params: PolicyParams, initial_k: int | None = None, profile: RoundProfile | None = None):
        self.params = params
        self.profile = profile
        self.slots = self._build(params, initial_k, profile)
        self.active = min(self.slots)

    @staticmethod
    def _build(params: PolicyParams, initial_k: int | None, profile: RoundProfile | None) -> dict[int, Policy]:
        slots = {s.min_batch_size: s.candidate_k for s in params.slots}
        slots.setdefault(1, params.candidate_k)
        make = STRATEGIES[params.strategy]
        return {size: make(params, initial_k, ks, profile) for size, ks in slots.items()}

    def slot_for(self, batch_size: int) -> int:
        return max((s for s in self.slots if s <= max(batch_size, 1)), default=min(self.slots))

    @property
    def k(self) -> int:
        return self.slots[self.active].k

    @property
    def candidates(self) -> list[int]:
        return self.slots[self.active].candidates

    @property
    def serving(self) -> int:
        return self.slots[self.active].serving

    @property
    def ema(self) -> float | None:
        return self.slots[self.active].ema

    def observe(self, observation: Observation) -> Decision | None:
        if not observation.accepted:
            return None
        slot = self.slot_for(observation.batch_size)
        moved = slot != self.active
        self.active = slot
        decision = self.slots[slot].observe(observation)
        if decision is None and moved:
            return Decision(self.k, "slot")
        return decision

    def row_ks(self, ids: Seq[str]) -> Mapping[str, int] | None:
        return self.slots[self.active].row_ks(ids)

    def set_k(self, k: int) -> None:
        self.slots[self.active].set_k(k)

    def update_params(self, params: PolicyParams) -> None:
        if params.strategy != self.params.strategy or {s.min_batch_size for s in params.slots} != {
            s.min_batch_size for s in self.params.slots
        }:
            # Another strategy or other slot boundaries: start afresh from the current k.
            current = self.k
            self.params = params
            self.slots = self._build(params, current, self.profile)
            self.active = min(self.slots)
            return
        self.params = params
        lists = {s.min_batch_size: s.candidate_k for s in params.slots}
        lists.setdefault(1, params.candidate_k)
        for size, policy in self.slots.items():
            policy.update_params(replace(params, candidate_k=lists[size]))
