"""Adaptive draft-length policies: which k the next round should use.

A policy sees every verified round (the accepted drafts of each request, the batch size, what the
round cost) and may decide to move to another k. It never touches the engine: the controller
applies its decisions between rounds.

- `MeasuredPolicy` (measured.py) keeps to the k whose rounds were measured to serve
  the most tokens per second at the current batch size, and now and then tries its neighbours on
  the candidate ladder, as often as an exploration budget allows.
- `PositionalPolicy` (positional.py, the default) counts how often each draft position is kept
  wherever a round reached it (a round at k says what every shorter k would have emitted), times
  each k's rounds, serves the k with the most tokens per second, and tries other k a single
  round at a time (the next longer one, and shorter ones until their seconds are known), as
  often as an exploration budget allows.
- `EmaPolicy` (ema.py) follows SGLang's adaptive speculative decoding: an EMA of accepted drafts
  per request, and a threshold ladder over the sorted candidates with hysteresis.
- `SlottedPolicy` (slots.py) keeps a separate candidate list and policy state per batch-size range.

Every strategy shares its clock (schedule.py): warm-up, decision interval, probing from k = 0,
snapping to the candidates and parameter swaps.
"""

from __future__ import annotations

from engine.policy.contracts import Decision, Observation, Policy, RoundProfile, snap
from engine.policy.ema import EmaPolicy
from engine.policy.measured import STALL_FACTOR, MeasuredPolicy, window_rate
from engine.policy.params import STRATEGY_NAMES, BatchSlot, PolicyParams
from engine.policy.positional import PositionalPolicy
from engine.policy.slots import STRATEGIES, SlottedPolicy


def make_policy(params: PolicyParams, initial_k: int | None = None, profile: RoundProfile | None = None) -> Policy:
    if params.slots:
        return SlottedPolicy(params, initial_k, profile)
    return STRATEGIES[params.strategy](params, initial_k, profile=profile)


__all__ = [
    "STALL_FACTOR",
    "STRATEGY_NAMES",
    "BatchSlot",
    "Decision",
    "EmaPolicy",
    "MeasuredPolicy",
    "Observation",
    "Policy",
    "PolicyParams",
    "RoundProfile",
    "PositionalPolicy",
    "SlottedPolicy",
    "make_policy",
    "snap",
    "window_rate",
]
