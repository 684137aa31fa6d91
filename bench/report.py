"""What a mode served, and how the modes compare: the table, the per-phase oracle, the JSON and the plot."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModeReport:
    tokens: int = 0
    seconds: float = 0.0
    verified: int = 0  # request-rounds
    accepted: int = 0
    switches: int = 0
    k_rounds: Counter = field(default_factory=Counter)
    # Where the rounds' seconds went, from the engine's own timings; the rest is the round's own work.
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    phase_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    phase_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, k, tokens)
    runs: list[float] = field(default_factory=list)  # tokens/s of each run merged in
    # every round: (k, tokens, seconds less prefill's, whether it was a try of another k than the one served)
    rounds: list[tuple[int, int, float, bool]] = field(default_factory=list)

    def merge(self, other: ModeReport) -> None:
        """Add another run of the same mode (its timeline is kept, offset to follow this one)."""
        self.runs.extend(other.runs or [other.tokens / max(other.seconds, 1e-9)])
        offset = self.seconds
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.verified += other.verified
        self.accepted += other.accepted
        self.switches += other.switches
        self.k_rounds.update(other.k_rounds)
        self.prefill_seconds += other.prefill_seconds
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        for phase in other.phase_tokens:
            self.phase_tokens[phase] += other.phase_tokens[phase]
            self.phase_seconds[phase] += other.phase_seconds[phase]
        self.timeline.extend((t + offset, k, n) for t, k, n in other.timeline)
        self.rounds.extend(other.rounds)

    def losses(self, rate: float, best_k: int) -> dict[str, tuple[float, int]]:
        """Where this mode's decoding time went beyond serving its tokens at `rate` (the best
        static k's tokens over its decoding seconds), as shares of this mode's time, and the
        rounds each share is on: tries of other k's, and rounds served at each k. Prefill, the
        same in every mode, is left out. A share can be negative: rounds that served faster than
        the best static k's average."""
        lost: dict[str, float] = defaultdict(float)
        counts: Counter = Counter()
        for k, tokens, seconds, tried in self.rounds:
            name = "tries" if tried else f"k={k}" + (" (best)" if k == best_k else "")
            lost[name] += (seconds - tokens / rate) / self.seconds
            counts[name] += 1
        return {name: (lost[name], counts[name]) for name in sorted(lost, key=lambda n: -lost[n])}

    def round_ms(self) -> dict[str, float]:
        """Milliseconds a round (in-process modes): drafting, the verify forward, and the rest of
        the round (accepting, the drafter's extend, bookkeeping), prefill left out."""
        rounds = max(sum(self.k_rounds.values()), 1)
        rest = self.seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds
        parts = {"draft": self.draft_seconds, "verify": self.verify_seconds, "rest": max(rest, 0.0)}
        return {name: 1e3 * seconds / rounds for name, seconds in parts.items()}

    def as_json(self) -> dict:
        return {
            "tokens_per_s": self.tokens / self.seconds,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "mean_accepted_drafts": self.accepted / max(self.verified, 1),
            "switches": self.switches,
            "runs_tokens_per_s": list(self.runs),
            "k_histogram": {str(k): n for k, n in sorted(self.k_rounds.items())},
            "round_ms": self.round_ms(),
            "prefill_seconds": self.prefill_seconds,
            "phases": {
                phase: {
                    "tokens_per_s": self.phase_tokens[phase] / max(self.phase_seconds[phase], 1e-9),
                    "tokens": self.phase_tokens[phase],
                    "seconds": self.phase_seconds[phase],
                }
                for phase in self.phase_tokens
            },
        }


def write_reports(path: Path, reports: dict[str, ModeReport]) -> None:
    path.write_text(json.dumps({"modes": {m: r.as_json() for m, r in reports.items()}}, indent=2) + "\n")


def print_table(reports: dict[str, ModeReport]) -> None:
    baseline = reports.get("none")
    phases = sorted({p for r in reports.values() for p in r.phase_tokens})
    header = f"{'mode':<18} {'tok/s':>8} {'x none':>7} {'acc/round':>9} {'switches':>8}  " + " ".join(
        f"{p + ' tok/s':>14}" for p in phases
    )
    print(header)
    for mode, r in reports.items():
        ratio = f"{(r.tokens / r.seconds) / (baseline.tokens / baseline.seconds):.2f}x" if baseline else "-"
        per_phase = " ".join(f"{r.phase_tokens[p] / max(r.phase_seconds[p], 1e-9):>14.1f}" for p in phases)
        print(
            f"{mode:<18} {r.tokens / r.seconds:>8.1f} {ratio:>7} {r.accepted / max(r.verified, 1):>9.2f} "
            f"{r.switches:>8}  {per_phase}"
        )
    for mode, r in reports.items():
        histogram = " ".join(f"k={k}:{n}" for k, n in sorted(r.k_rounds.items()))
        print(f"  {mode:<16} rounds by k: {histogram}")
    for mode, r in reports.items():
        if r.draft_seconds or r.verify_seconds:  # in-process: the engine timed its phases
            ms = r.round_ms()
            print(
                f"  {mode:<16} ms a round: draft {ms['draft']:.3f}, verify {ms['verify']:.3f}, "
                f"rest {ms['rest']:.3f}; prefill {r.prefill_seconds:.2f} s in all"
            )
    # `none` is static k = 0: a policy that turns speculation off must beat it too.
    statics = {m: r for m, r in reports.items() if m == "none" or m.startswith("static:")}
    if statics:
        best_mode = max(statics, key=lambda m: statics[m].tokens / statics[m].seconds)
        best = statics[best_mode].tokens / statics[best_mode].seconds
        oracle, fastest = per_phase_oracle(statics, phases)
        picks = ", ".join(f"{p}: {fastest[p]}" for p in phases)
        print(f"best static: {best_mode} {best:.1f} tok/s; per-phase oracle: {oracle:.1f} tok/s ({picks})")
        for mode, r in reports.items():
            if mode.startswith("adaptive:"):
                rate = r.tokens / r.seconds
                # Run by run against the same static mode, run side by side with it: their spread
                # is the noise a single figure carries.
                runs = [a / b for a, b in zip(r.runs, statics[best_mode].runs)]
                spread = f" (runs {', '.join(f'{x:.3f}' for x in runs)})" if len(runs) > 1 else ""
                print(f"  {mode}: {rate / best:.3f}x best static{spread}, {rate / oracle:.3f}x per-phase oracle")
                if r.rounds:
                    fastest = statics[best_mode]
                    decoding = fastest.tokens / (fastest.seconds - fastest.prefill_seconds)
                    best_k = 0 if best_mode.startswith("none") else int(best_mode.split("+")[0].split(":")[1])
                    parts = ", ".join(
                        f"{name} {100 * share:+.1f}% ({rounds} rounds)"
                        for name, (share, rounds) in r.losses(decoding, best_k).items()
                    )
                    print(f"    time beyond the best static k's: {parts}")


def phase_rate(report: ModeReport, phase: str) -> float:
    return report.phase_tokens[phase] / max(report.phase_seconds[phase], 1e-9)


def per_phase_oracle(statics: dict[str, ModeReport], phases: list[str]) -> tuple[float, dict[str, str]]:
    """Tokens/s of serving each phase with its fastest static mode, and those modes by phase.

    Sampled requests may stop at EOS sooner in one mode than in another, so phases are compared
    by rate: the oracle serves each phase's tokens (their mean over the modes) at that phase's
    best static rate."""
    fastest = {p: max(statics, key=lambda m: phase_rate(statics[m], p)) for p in phases}
    tokens = {p: sum(r.phase_tokens[p] for r in statics.values()) / len(statics) for p in phases}
    oracle = sum(tokens.values()) / sum(tokens[p] / phase_rate(statics[fastest[p]], p) for p in phases)
    return oracle, fastest


def plot(reports: dict[str, ModeReport], out: Path, window: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_k, ax_rate) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for mode, r in reports.items():
        times = [t for t, _, _ in r.timeline]
        ax_k.step(times, [k for _, k, _ in r.timeline], where="post", label=mode, linewidth=1)
        rates, start, acc = [], 0, 0
        for t, _, n in r.timeline:
            acc += n
            while r.timeline[start][0] < t - window:
                acc -= r.timeline[start][2]
                start += 1
            rates.append(acc / window if t >= window else acc / max(t, 1e-9))
        ax_rate.plot(times, rates, label=mode, linewidth=1)
    ax_k.set_ylabel("draft length k")
    ax_rate.set_ylabel(f"tokens/s ({window:.0f} s window)")
    ax_rate.set_xlabel("seconds")
    ax_k.legend(fontsize="small", ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
