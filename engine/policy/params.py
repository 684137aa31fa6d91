"""The policy's parameters: what [adaptive] in the config sets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSlot:
    """Candidates used while the batch holds at least `min_batch_size` sequences."""

    min_batch_size: int
    candidate_k: tuple[int, ...]


# Each strategy's candidates where none are configured: SGLang's for ema; for measured, which
# tries only a k's neighbours, a ladder fine enough that a neighbour is a small step (4 was added
# on the tuning half of the workload suite: at batch 1 the best k is often 4 or 5, and 3 and 5
# were too far apart to climb between on a 2% margin; docs/benchmarks.md).
DEFAULT_CANDIDATES = {"ema": (1, 3, 7), "measured": (0, 1, 2, 3, 4, 5, 7), "positional": (0, 1, 2, 3, 4, 5, 7)}


@dataclass(frozen=True)
class PolicyParams:
    strategy: str = "ema"  # "ema" or "measured"
    candidate_k: tuple[int, ...] = (1, 3, 7)
    ema_alpha: float = 0.2
    warmup_batches: int = 10
    update_interval: int = 5
    up_hysteresis: float = 0.0
    down_hysteresis: float = -0.25
    slots: tuple[BatchSlot, ...] = ()
    # ema: at k = 0 nothing is drafted, so nothing is learnt: every probe_interval rounds, try the
    # smallest k > 0 for a while. measured: the fewest rounds between tries of a neighbour.
    probe_interval: int = 10
    # measured: keep a tried k only when it beat the one left by this fraction. 0.02 was chosen
    # on the tuning half of the workload suite (docs/benchmarks.md).
    switch_margin: float = 0.02
    # measured: the share of serving time that tries of another k may lose. 0.01 was chosen on
    # the tuning half of the workload suite (docs/benchmarks.md).
    exploration: float = 0.01
    # measured: each further try of a shorter neighbour that lost again waits this many times
    # longer. 2 was chosen on the tuning half of the workload suite (docs/benchmarks.md).
    exploration_backoff: float = 2.0
    # How sure the drafter must be of a draft for it to be verified (0: all k): a DFlash block's
    # running product of its positions' probabilities, an EAGLE-3 greedy chain's each draft.
    # 0.1 was chosen on the tuning half of code-greedy for each (docs/benchmarks.md).
    draft_confidence: float = 0.1

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        if self.strategy not in DEFAULT_CANDIDATES:
            out.append(f"strategy must be one of {', '.join(DEFAULT_CANDIDATES)}, got {self.strategy!r}")
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
