"""How many threads the compiled CPU forward runs on: chosen, like k, from measured rounds.

The kernels' threads meet at a barrier after every operation. On idle cores that costs little and
all of them together are fastest; when another process takes a core, the scheduler gives the
team's threads turns of milliseconds, the others wait at each barrier for the one away, and a
round takes several times as long as on fewer threads (on two cores beside one busy process, one
thread served 2.7x what two did). Which count is faster is a property of the machine's load now,
not of the model, so it is measured on live rounds; the operating system says when to measure.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

# Served rounds whose seconds per unit are what the served count costs now (a mean, not a median:
# beside a busy process most of a team's rounds run at full speed and a few wait out a whole turn
# of another thread, 1.1 ms a round in the median and 4.8 ms in the mean on the toy target: the
# rare long ones are the cost).
SERVED_ROUNDS = 64
# A try, and each look at the load, spans as many rounds as take this long at the served pace
# (at least SPAN_ROUNDS): long enough to meet the scheduler's turns, which last milliseconds.
SPAN_ROUNDS = 4
SPAN_SECONDS = 0.05
# How much faster a tried count must be to be served: the counts differ by 1.5x or more where it
# matters, and a try is short.
MARGIN = 0.1
# The share of serving time tries of another count may lose, and the bounds on their spacing.
EXPLORATION = 0.01
MIN_SPACING = 32
# Where the load is known it calls the tries that matter, and the others (is one thread faster on
# idle cores?) come at most this often: each costs its rounds' bookkeeping beside a few slow rounds.
QUIET_SPACING = 512
MAX_SPACING = 4096
# The load: threads that waited for a core this share of a span's time (summed over threads), or
# this many cores idle through it, call for a try of fewer or more threads.
WAITED = 0.2
IDLE_CORES = 0.5


class LoadProbe(Protocol):
    def __call__(self) -> tuple[float, float] | None:
        """Seconds this process's threads have waited for a core while runnable, and seconds the
        usable cores have been idle, both since any fixed moment; None where not known."""
        ...


class ProcLoad:
    """LoadProbe from Linux's /proc: the run-queue wait (schedstat) of the threads that share the
    name of the thread that made it (the engine thread, and the kernels' threads it started, which
    inherit its name: a busy event loop's waits are not the kernels'), and the idle time of the
    cores this process may use (/proc/stat, in clock ticks)."""

    def __init__(self) -> None:
        self.name = self._name("thread-self")
        self.ours: dict[str, bool] = {}  # thread id -> whether it is one of the engine's

    @staticmethod
    def _name(task: str) -> str | None:
        try:
            with open(f"/proc/{task}/comm") as f:
                return f.read()
        except OSError:
            return None

    def __call__(self) -> tuple[float, float] | None:
        if self.name is None:
            return None
        try:
            waited = 0
            for tid in os.listdir("/proc/self/task"):
                if tid not in self.ours:
                    self.ours[tid] = self._name(f"self/task/{tid}") == self.name
                if self.ours[tid]:
                    try:
                        with open(f"/proc/self/task/{tid}/schedstat") as f:
                            waited += int(f.read().split()[1])
                    except FileNotFoundError:
                        continue  # a thread that ended meanwhile
            usable = {f"cpu{c}" for c in os.sched_getaffinity(0)}
            idle_ticks = 0
            with open("/proc/stat") as f:
                for line in f:
                    name, *fields = line.split()
                    if name in usable:
                        idle_ticks += int(fields[3]) + int(fields[4])  # idle and iowait
            return waited / 1e9, idle_ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, AttributeError):
            return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity, a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def counts_below(most: int) -> list[int]:
    """The counts tried: all the cores, then halvings down to one."""
    counts = [most]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return counts


class Rounds:
    """Rounds' seconds and what their kinds cost in the policy's units. A span's `length` (its
    rounds) is fixed as it starts: a span ended by its seconds would end at its first long round,
    and a team's stalls would look rarer than they are."""

    def __init__(self, maxlen: int | None = None, length: int = SPAN_ROUNDS) -> None:
        self.rounds: deque[tuple[float, float]] = deque(maxlen=maxlen)
        self.seconds = self.units = 0.0
        self.length = length

    def add(self, seconds: float, units: float) -> None:
        if len(self.rounds) == self.rounds.maxlen:
            old_seconds, old_units = self.rounds[0]
            self.seconds, self.units = self.seconds - old_seconds, self.units - old_units
        self.rounds.append((seconds, units))
        self.seconds, self.units = self.seconds + seconds, self.units + units

    @property
    def full(self) -> bool:
        return len(self.rounds) >= self.length

    @property
    def level(self) -> float:
        """Seconds per unit: lower is faster."""
        return self.seconds / self.units


class ThreadPolicy:
    """Serve the thread count whose rounds are fastest now, and try another when the load says so.

    Rounds of different kinds (k, batch size) cost different seconds, but a thread count speeds or
    slows them alike: so each round is counted in units of its kind (what the start-up timing on
    every core says it costs, or for a kind not timed, its first served rounds), and counts are
    compared by seconds per unit. A try runs a span of rounds at a neighbouring count; the count
    whose span ran `MARGIN` faster than the served count's recent rounds (and, with more threads,
    without waiting for cores) is served from the next round. A try comes when, over a span of
    served rounds, the process's threads waited for a core (another process took one: fewer
    threads), or a core stood idle (more threads; not again while it stays idle after such a try
    lost), and otherwise as often as keeps what tries lose within `EXPLORATION` of the serving
    time (where the load is known, at most every QUIET_SPACING rounds). A pinned count is never
    left.
    """

    def __init__(
        self,
        most: int,
        pinned: int | None = None,
        profile: Mapping[tuple[int, int], float] | None = None,
        load: LoadProbe | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.candidates = [pinned] if pinned else counts_below(max(1, most))
        self.serving = self.candidates[0]
        self.threads = self.serving  # the next round's
        self.rounds = 0
        self.switches = 0
        self.units: dict[tuple[int, int], float] = dict(profile or {})  # (k, batch size) -> seconds
        self.first: dict[tuple[int, int], list[float]] = {}  # a kind not timed: its first rounds
        self.served = Rounds(SERVED_ROUNDS)  # the served count's recent rounds
        self.span = Rounds()  # a try's rounds, or the served rounds since the last look at the load
        self.load, self.clock = (load if load is not None else ProcLoad()), clock
        self.last_look = self._look()
        # Where the load is known, it calls a try the moment threads wait for a core or a core
        # stands idle, and tries it does not call (whether fewer threads are faster on idle cores,
        # as for a small model at a long context) come at most every QUIET_SPACING rounds;
        # without it, the first try comes as soon as the served rounds say what they cost.
        self.least_spacing = QUIET_SPACING if self.last_look is not None else MIN_SPACING
        self.due = 0 if self.last_look is None else QUIET_SPACING
        self.next_try = 0  # which neighbour of the served count is tried next
        self.direction = 0  # what the load asked for: -1 fewer threads, 1 more, 0 either
        self.called = 0  # what the load asked for when the current try started
        self.refused = 0  # 1: an idle core called a try of more threads that lost, and is still idle

    @property
    def trying(self) -> bool:
        return self.threads != self.serving

    def observe(self, k: int, batch_size: int, seconds: float) -> bool:
        """Count a round run on `self.threads` threads; True when the served count changed (what
        every k costs changed with it)."""
        self.rounds += 1
        if len(self.candidates) == 1 or seconds <= 0 or (units := self._units(k, batch_size, seconds)) is None:
            return False
        self.span.add(seconds, units)
        if self.trying:
            # One thread's rounds are steady, and a team's run at speed unless another process's
            # turn stalls them: a try behind after a few rounds, or after a span's seconds, is no
            # bad luck (a fast start may be, so that one runs the whole span).
            started = len(self.span.rounds) >= SPAN_ROUNDS or self.span.seconds >= SPAN_SECONDS
            if (started and self.span.level > (1 + MARGIN) * self.served.level) or self.span.full:
                return self._judge()
            return False
        if self.span.full:
            waited, idle = self._load_since_last_look()
            wanted = -1 if waited > WAITED else 1 if idle > IDLE_CORES else 0
            # An idle core that already called a try of more threads which lost calls none while
            # it stays idle (a small model may be fastest on one thread, and leave a core idle).
            # Threads waiting for cores call a try every time: a team's lucky rounds may have
            # won the last one, and fewer threads cost little to try there.
            if wanted != self.refused:
                self.refused = 0
                if wanted and self._neighbours(wanted):
                    self.direction, self.due = wanted, min(self.due, self.rounds)
            for round_seconds, round_units in self.span.rounds:
                self.served.add(round_seconds, round_units)
            self.span = self._new_span()
        if self.served.seconds >= SPAN_SECONDS and len(self.served.rounds) >= SPAN_ROUNDS and self.rounds >= self.due:
            self._start_try()
        return False

    def _neighbours(self, direction: int) -> list[int]:
        """The counts next to the served one: fewer (-1), more (1) or both (0)."""
        fewer = [c for c in self.candidates if c < self.serving][:1]
        more = [c for c in self.candidates if c > self.serving][-1:]
        return {-1: fewer, 1: more, 0: fewer + more}[direction]

    def _start_try(self) -> None:
        options, self.called, self.direction = self._neighbours(self.direction), self.direction, 0
        self.threads = options[self.next_try % len(options)]
        self.next_try += 1
        self.span = self._new_span()
        self._load_since_last_look()

    def _judge(self) -> bool:
        """End a try: serve the tried count if its span ran `MARGIN` faster than the served
        rounds (with more threads, without waiting for cores), and space the next try by what
        this one lost."""
        tried, span = self.threads, self.span
        self.threads, self.span = self.serving, self._new_span()
        waited, _ = self._load_since_last_look()
        if tried > self.serving and waited > WAITED:
            # More threads that waited for cores: their few rounds were lucky if fast. Tried
            # again when a core is seen idle, or after the longest spacing.
            self.due, self.refused = self.rounds + MAX_SPACING, max(self.called, 0)
            return False
        if span.level * (1 + MARGIN) < self.served.level:
            self.serving = self.threads = tried
            self.switches, self.refused = self.switches + 1, 0
            self.served = Rounds(SERVED_ROUNDS)
            self.due = self.rounds + MIN_SPACING
            return True
        self.refused = max(self.called, 0)
        lost = max(0.0, span.seconds / (self.served.level * span.units) - 1) * len(span.rounds)  # in rounds
        self.due = self.rounds + int(min(MAX_SPACING, max(self.least_spacing, lost / EXPLORATION)))
        return False

    def _look(self) -> tuple[float, float, float] | None:
        sample = self.load()
        return None if sample is None else (self.clock(), *sample)

    def _load_since_last_look(self) -> tuple[float, float]:
        """The share of the time since the last look that the threads waited for a core (summed
        over threads), and the cores idle through it; (0, 0) where the load is not known."""
        now, before = self._look(), self.last_look
        self.last_look = now
        if now is None or before is None or now[0] <= before[0]:
            return 0.0, 0.0
        wall = now[0] - before[0]
        return (now[1] - before[1]) / wall, (now[2] - before[2]) / wall

    def _new_span(self) -> Rounds:
        """A span of as many rounds as take SPAN_SECONDS at the served pace (at least SPAN_ROUNDS)."""
        served = self.served
        per_round = served.seconds / len(served.rounds) if served.rounds else SPAN_SECONDS
        return Rounds(length=max(SPAN_ROUNDS, math.ceil(SPAN_SECONDS / per_round)))

    def _units(self, k: int, batch_size: int, seconds: float) -> float | None:
        """What a round of this kind counts for; None while a kind not timed is being learnt."""
        kind = (k, batch_size)
        if kind in self.units:
            return self.units[kind]
        first = self.first.setdefault(kind, [])
        first.append(seconds)
        if len(first) == SPAN_ROUNDS:
            self.units[kind] = min(first)  # its fastest: a stalled round is not what it costs
            del self.first[kind]
        return None
