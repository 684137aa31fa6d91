"""Adaptive step policies: which k the next round should use.

A policy sees every verified round (the accepted drafts of each request, the batch size, what the
round cost) and may decide to move to another k. It never touches the engine: the controller
applies its decisions between rounds.

- `EmaPolicy` (ema.py) follows SGLang's adaptive speculative decoding: an EMA of accepted drafts
  per request, and a threshold ladder over the sorted candidates with hysteresis.
- `GoodputPolicy` (goodput.py) is cost-aware: the k with the most expected tokens per second of
  measured round time (costs.py), and with `draft_cutoff` each round stops drafting where another
  draft step stops paying (cutoff.py, priced by calibration.py).
- `SlottedPolicy` (slots.py) keeps a separate candidate list and policy state per batch-size range.

Both strategies share their clock (schedule.py): warm-up, decision interval, probing from k = 0,
snapping to the candidates and parameter swaps.
"""

from __future__ import annotations

from engine.policy.calibration import Calibration, LookupCalibration
from engine.policy.contracts import (
    Decision,
    DraftChain,
    DraftRecord,
    KeepDrafting,
    Observation,
    Policy,
    VerifyCurve,
    snap,
)
from engine.policy.costs import STALL_FACTOR, CostModel, LinearFit
from engine.policy.cutoff import RoundCutoff
from engine.policy.ema import EmaPolicy
from engine.policy.goodput import GoodputPolicy
from engine.policy.measured import MeasuredPolicy
from engine.policy.params import DEFAULT_CANDIDATES, BatchSlot, PolicyParams
from engine.policy.slots import STRATEGIES, SlottedPolicy


def make_policy(params: PolicyParams, initial_steps: int | None = None) -> Policy:
    if params.slots:
        return SlottedPolicy(params, initial_steps)
    return STRATEGIES[params.strategy](params, initial_steps)


__all__ = [
    "DEFAULT_CANDIDATES",
    "STALL_FACTOR",
    "BatchSlot",
    "Calibration",
    "CostModel",
    "Decision",
    "DraftChain",
    "DraftRecord",
    "EmaPolicy",
    "GoodputPolicy",
    "KeepDrafting",
    "LinearFit",
    "LookupCalibration",
    "MeasuredPolicy",
    "Observation",
    "Policy",
    "PolicyParams",
    "RoundCutoff",
    "SlottedPolicy",
    "VerifyCurve",
    "make_policy",
    "snap",
]
