"""The policy's parameters: what [adaptive] in the config sets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSlot:
    """Candidates used while the batch holds at least `min_batch_size` sequences."""

    min_batch_size: int
    candidate_k: tuple[int, ...]


# The strategies there are (each one's class: slots.STRATEGIES).
STRATEGY_NAMES = ("measured", "positional", "ema")


@dataclass(frozen=True)
class PolicyParams:
    """What [adaptive] sets for the policy. Every field is required: the config schema
    (control/schema.py) holds the one default of each, and `control.schema.policy_params` builds
    params from those defaults for code that has no file."""

    strategy: str
    candidate_k: tuple[int, ...]
    ema_alpha: float  # ema: the weight of the newest round in its acceptance EMA
    warmup_batches: int
    update_interval: int
    up_hysteresis: float  # ema
    down_hysteresis: float  # ema
    slots: tuple[BatchSlot, ...]
    # ema: at k = 0 nothing is drafted, so nothing is learnt: every probe_interval rounds, try the
    # smallest k > 0 for a while. measured and positional: the fewest rounds between tries of
    # another k.
    probe_interval: int
    # measured: keep a tried k only when it beat the one left by this fraction; positional: move
    # only to a k estimated this much faster.
    switch_margin: float
    # measured and positional: the share of serving time that tries of another k may lose.
    exploration: float
    # measured: each further try of a shorter neighbour that lost again waits this many times longer.
    exploration_backoff: float
    # How sure the drafter must be of a draft for it to be verified (0: all k): a DFlash block's
    # running product of its positions' probabilities, an EAGLE-3 greedy chain's each draft.
    draft_confidence: float
    # positional: each running sequence drafts its own k, by its own acceptance at each position.
    per_sequence: bool

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        if self.strategy not in STRATEGY_NAMES:
            out.append(f"strategy must be one of {', '.join(STRATEGY_NAMES)}, got {self.strategy!r}")
        for name, ks in [("candidate_k", self.candidate_k)] + [
            (f"slots[{i}].candidate_k", s.candidate_k) for i, s in enumerate(self.slots)
        ]:
            if not ks:
                out.append(f"{name} must not be empty")
            elif any(k < 0 for k in ks):
                out.append(f"{name} must hold draft lengths >= 0, got {list(ks)}")
            elif len(set(ks)) != len(ks):
                out.append(f"{name} has duplicates: {list(ks)}")
        if not 0 < self.ema_alpha <= 1:
            out.append(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.warmup_batches < 0:
            out.append(f"warmup_batches must be >= 0, got {self.warmup_batches}")
        if self.update_interval < 1:
            out.append(f"update_interval must be >= 1, got {self.update_interval}")
        if self.probe_interval < 1:
            out.append(f"probe_interval must be >= 1, got {self.probe_interval}")
        if not 0 < self.exploration <= 1:
            out.append(f"exploration must be in (0, 1], got {self.exploration}")
        if self.exploration_backoff < 1:
            out.append(f"exploration_backoff must be >= 1, got {self.exploration_backoff}")
        if not 0 <= self.draft_confidence <= 1:
            out.append(f"draft_confidence must be in [0, 1], got {self.draft_confidence}")
        if self.switch_margin < 0:
            out.append(f"switch_margin must be >= 0, got {self.switch_margin}")
        sizes = [s.min_batch_size for s in self.slots]
        if any(s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
            out.append(f"slots need distinct min_batch_size >= 1, got {sizes}")
        return out

    @property
    def all_k(self) -> tuple[int, ...]:
        """Every k any slot may choose: each needs a runtime state."""
        ks = set(self.candidate_k)
        for slot in self.slots:
            ks.update(slot.candidate_k)
        return tuple(sorted(ks))
