"""Prompt lookup: n-gram drafting from the sequence's own context (and earlier sequences'),
alone or in front of a model drafter."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from typing import Any

import numpy as np
from torch import Tensor

from engine.confidence import EVERY_DRAFT, ConfidenceRule, count_chain, keep_ratios
from engine.drafters.base import Drafter, Proposal
from engine.request import Sequence


class NgramIndex:
    """Where each n-gram of a growing token list last occurred with a token after it, for
    min_n <= n <= max_n: a prompt lookup costs a few dictionary reads instead of a scan of the
    context. It follows `tokens` as they grow (the tokens it has read must not change)."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.starts: dict[tuple[int, ...], int] = {}
        self.read = 0  # tokens indexed so far

    def find(self, tokens: Seq[int]) -> tuple[int, int]:
        """Where the latest earlier occurrence of the last n tokens ends (longest n first), and
        that n; (0, 0) when no suffix occurred before."""
        for end in range(self.read, len(tokens)):
            # tokens[end] follows the n-grams that end just before it.
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.starts[tuple(tokens[end - n : end])] = end - n
        self.read = len(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.starts.get(tuple(tokens[length - n :]))
            if start is not None:
                return start + n, n
        return 0, 0

    def continuation(self, tokens: Seq[int], k: int) -> tuple[list[int], int]:
        """What followed the latest earlier occurrence of the last n tokens (longest n first),
        at most k tokens, and how many tokens before it match the context's last ones (n, or
        more where the context repeats beyond max_n); empty and 0 when no suffix occurred before."""
        end, n = self.find(tokens)
        if n == 0:
            return [], 0
        out = list(tokens[end : end + k])
        # A match `period` tokens back repeats with that period: where what followed it runs
        # into the end of the context, the continuation goes on copying itself.
        period = len(tokens) - end
        while len(out) < k:
            out.append(out[len(out) - period])
        return out, n if n < self.max_n else matched(tokens, tokens, end)


# How far back a match is followed: past this, a longer match says nothing more about the chain.
LONGEST_MATCH = 32


def matched(context: Seq[int], source: Seq[int], end: int) -> int:
    """How many tokens of `source` before `end` equal the last ones of `context` (at most
    LONGEST_MATCH): the longer, the likelier what followed them follows the context too."""
    n, last = 0, len(context) - 1
    while n < LONGEST_MATCH and n < end and n <= last and source[end - 1 - n] == context[last - n]:
        n += 1
    return n


# The n-gram hash the history indexes by: a polynomial in the tokens, mod 2^64, so that every
# window of a finished text hashes in a few whole-array operations (Python's tuple hash, a slice
# and a hash a window, cost 1.2 ms a finished sequence of 450 tokens).
_BASE = 1_000_003
_MASK = (1 << 64) - 1


def ngram_hash(tokens: Seq[int]) -> int:
    """The history's hash of one n-gram."""
    h = 0
    for token in tokens:
        h = (h * _BASE + token) & _MASK
    return h


def window_hashes(text: Seq[int], spans: Seq[int]) -> dict[int, np.ndarray]:
    """`ngram_hash` of the window at every start of `text`, for each span (powers of two): a
    window of 2n is its first n-gram's hash times BASE^n plus its second's."""
    hashes, n = {1: np.asarray(text, dtype=np.uint64)}, 1
    while n < max(spans):
        shorter = hashes[n]
        hashes[2 * n] = shorter[:-n] * np.uint64(pow(_BASE, n, _MASK + 1)) + shorter[n:]
        n *= 2
    return {n: hashes[n] for n in spans}


class LookupHistory:
    """The tokens of sequences that finished, for lookups across requests: a request that repeats
    an earlier one (the same prompt, boilerplate another request wrote) finds what followed there.

    Held to `capacity` tokens, the oldest sequences forgotten first. Only long n-grams (4 to 32
    tokens) are indexed: across unrelated requests a short match is chance. Keys are hashes of the
    n-grams, checked against the tokens on a hit, so the index does not hold the n-grams themselves.
    """

    spans = (32, 16, 8, 4)

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.texts: dict[int, tuple[int, ...]] = {}  # in the order they were added
        self.starts: dict[int, tuple[int, int]] = {}  # hash of an n-gram -> (text, start)
        self.size = 0
        self.added = 0

    def add(self, tokens: Seq[int]) -> None:
        text = tuple(tokens[-self.capacity :]) if self.capacity > 0 else ()
        if len(text) <= self.spans[-1]:
            return
        number = self.added
        self.added += 1
        self.texts[number] = text
        self.size += len(text)
        for keys in self._ngrams(text):
            self.starts.update(zip(keys, zip(itertools.repeat(number), range(len(keys)))))
        while self.size > self.capacity:
            self._forget(next(iter(self.texts)))

    def _forget(self, number: int) -> None:
        text = self.texts.pop(number)
        self.size -= len(text)
        starts = self.starts
        for keys in self._ngrams(text):
            for start, key in enumerate(keys):
                if starts.get(key) == (number, start):
                    del starts[key]

    def _ngrams(self, text: tuple[int, ...]) -> list[list[int]]:
        """For each span, longest first, the hashes of the n-grams of `text` that have a token
        after them, by start."""
        hashes = window_hashes(text, self.spans)
        return [hashes[n][: len(text) - n].tolist() for n in self.spans if len(text) > n]

    def continuation(self, tokens: Seq[int], k: int) -> tuple[list[int], int]:
        """What followed the latest occurrence of the context's longest indexed suffix in an
        earlier sequence (at most k tokens), and how many tokens matched; empty and 0 if none."""
        # The suffixes' hashes, shortest first, a token at a time from the end: a suffix whose
        # hash is not indexed never occurred, nor did any longer one (most lookups stop at 4).
        found, h, power, length = [], 0, 1, len(tokens)
        for n in range(1, min(self.spans[0], length) + 1):
            h = (h + tokens[length - n] * power) & _MASK
            power = power * _BASE & _MASK
            if n in self.spans:
                if h not in self.starts:
                    break
                found.append((n, h))
        for n, key in reversed(found):
            number, start = self.starts[key]
            text = self.texts[number]
            if list(text[start : start + n]) == list(tokens[length - n :]):
                end = start + n
                return list(text[end : end + k]), matched(tokens, text, end)
        return [], 0


class MatchChances:
    """How often lookups' drafts are kept, by how long their match was: a lookup that matched one
    token is kept about a third of the time, one that matched eight or more nearly always
    (SmolLM2 on code). A draft's confidence is the chance, counted on earlier lookups of its kind,
    that it and every draft before it are kept: a round's ConfidenceRule cuts a weak lookup short
    instead of verifying drafts it will not keep (on a CPU each costs a row of the verify)."""

    # Counts are halved once a kind's lookups reach this many: the traffic moves.
    WINDOW = 512
    # A position not yet counted is believed as likely kept as the one before, with this weight;
    # the first, half the time.
    PRIOR = 2.0

    def __init__(self) -> None:
        # kind -> at each draft position j (index j; 0 unused), lookups that reached it, and kept it
        self.reached: dict[tuple[bool, int], list[float]] = {}
        self.kept: dict[tuple[bool, int], list[float]] = {}

    @staticmethod
    def kind(greedy: bool, match: int) -> tuple[bool, int]:
        """Matches of 1, 2, 3, 4 to 7, and 8 or more tokens; greedy rows apart from sampled ones
        (a sampled row keeps a lookup's draft only as often as the target draws it)."""
        return greedy, match if match < 4 else 4 if match < 8 else 5

    def confidence(self, kind: tuple[bool, int], n: int) -> list[float]:
        ratios = keep_ratios(self.reached.get(kind, [0.0]), self.kept.get(kind, [0.0]), self.PRIOR, n)
        return list(itertools.accumulate(ratios[1:], operator.mul))

    def count(self, kind: tuple[bool, int], verified: int, accepted: int) -> None:
        reached = self.reached.setdefault(kind, [0.0])
        kept = self.kept.setdefault(kind, [0.0])
        while len(reached) <= verified:
            reached.append(0.0)
            kept.append(0.0)
        count_chain(reached, kept, accepted, verified)
        if len(reached) > 1 and reached[1] >= self.WINDOW:
            self.reached[kind] = [n / 2 for n in reached]
            self.kept[kind] = [n / 2 for n in kept]


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (longest n
    first, from max_n down to min_n) and propose what followed it. No weights and no KV cache:
    each sequence gets an index of its n-grams, so a lookup does not scan the context (a
    1,500-token context with no match took 96 us to scan, 2.3 us to look up). With a
    `LookupHistory`, earlier sequences are looked in too, and the longer match wins.

    """

    name = "ngram"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, min_n: int = 1, max_n: int = 4, history: int = 0, by_match: bool = True) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[Sequence, NgramIndex] = {}
        self.history = LookupHistory(history) if history > 0 else None
        self.enabled = True  # False while the engine times what a hybrid's model costs
        self.full_width = False  # True while the engine times what each k costs (`timing`)
        # Whether drafts carry their match's chances (`MatchChances`), so that a round's rule can cut them.
        self.chances = MatchChances() if by_match else None
        self.proposed: dict[Sequence, tuple[tuple[bool, int], Proposal]] = {}  # each row's last lookup

    def admit(self, seqs: Seq[Sequence], hidden: dict[int, Tensor] | None = None) -> None:
        for seq in seqs:
            self.indexes[seq] = NgramIndex(self.min_n, self.max_n)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int], rule: ConfidenceRule = EVERY_DRAFT) -> list[Proposal]:
        # Deterministic: the drafter's distribution is one-hot.
        proposals = []
        for seq, k in zip(seqs, ks):
            tokens, match = self.lookup(seq, k)
            proposal = Proposal(tokens)
            # A timed round is verified whole and counts nothing (`timing`).
            if self.chances is not None and not self.full_width:
                kind = self.chances.kind(seq.params.greedy, match)
                proposal.confidence = self.chances.confidence(kind, len(tokens))
                if tokens:
                    self.proposed[seq] = (kind, proposal)
            proposals.append(proposal)
        if self.full_width:
            # A timed round verifies all k drafts, what a round at k costs where lookups find them;
            # what fills them matters not (a verify costs the same whatever its tokens say).
            for proposal, k in zip(proposals, ks):
                proposal.tokens += [0] * (k - len(proposal.tokens))
        return proposals

    def lookup(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """The sequence's own continuation, or an earlier sequence's where that matched longer
        (up to k tokens), and how many tokens matched; no tokens when neither has one. A sampled
        sequence looks in its own context only: its drafts decide its draws, and a seed's text
        must not depend on what other requests wrote."""
        if not self.enabled or k <= 0:
            return [], 0
        tokens, match = self.indexes[seq].continuation(seq.tokens, k)
        earlier_too = self.history is not None and seq.params.greedy
        if earlier_too and match < LONGEST_MATCH:  # else no earlier text can match longer
            earlier, earlier_match = self.history.continuation(seq.tokens, k)
            if earlier_match > match:
                tokens, match = earlier, earlier_match
        return tokens, match

    def accept(self, seqs: Seq[Sequence], accepted: Seq[int], hidden: dict[int, Tensor] | None = None) -> None:
        """Count how much of each row's lookup was kept, of what the round verified of it."""
        for seq, kept in zip(seqs, accepted):
            if self.chances is not None and (last := self.proposed.pop(seq, None)) is not None:
                kind, proposal = last
                self.chances.count(kind, len(proposal.tokens), kept)

    def release(self, seq: Sequence) -> None:
        self.proposed.pop(seq, None)
        if self.indexes.pop(seq, None) is not None and self.history is not None:
            self.history.add(seq.tokens)

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Each timed round drafts its full k (lookups find in the timed text whatever it happens
        to repeat, and a k would be timed at that width, not its own), and the timed sequences
        look in no earlier text, and leave none behind."""
        self.full_width = True
        try:
            with self.no_history():
                yield
        finally:
            self.full_width = False

    @contextmanager
    def no_history(self) -> Iterator[None]:
        saved, self.history = self.history, None
        try:
            yield
        finally:
            self.history = saved


class LookupFirst:
    """Prompt lookup in front of a model drafter (a mixin listed before the drafter's class, whose
    arguments it passes on; it takes the lookups' own as keywords): a greedy sequence whose context
    has seen its last n-grams before proposes what followed them, at no model cost; sequences
    without a match, and every sampled one, draft with the model. A deterministic draft x of a
    sampled sequence is kept with probability p(x) only, and at temperature 1 the lookups gained
    nothing."""

    def __init__(self, *args: Any, min_n: int = 1, max_n: int = 4, history: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # In front of a model every lookup is verified whole: cut by its match, the workload suite's
        # hybrid read 0.970x / 0.927x its best static k against 0.981x / 0.935x (held out,
        # concurrency 1 / 4, docs/benchmarks.md): a weak lookup stands in for a model that would keep more.
        self.lookups = NgramDrafter(min_n, max_n, history, by_match=False)

    def admit(self, seqs: Seq[Sequence], hidden: dict[int, Tensor] | None = None) -> None:
        super().admit(seqs, hidden)  # type: ignore[misc]
        self.lookups.admit(seqs)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int], rule: ConfidenceRule = EVERY_DRAFT) -> list[Proposal]:
        found = self.lookups.propose(seqs, [k if seq.params.greedy else 0 for seq, k in zip(seqs, ks)])
        rest = [0 if lookup.tokens else k for lookup, k in zip(found, ks)]
        drafted = super().propose(seqs, rest, rule)  # type: ignore[misc]
        return [lookup if lookup.tokens else proposal for lookup, proposal in zip(found, drafted)]

    def release(self, seq: Sequence) -> None:
        super().release(seq)  # type: ignore[misc]
        self.lookups.release(seq)

    @contextmanager
    def timing(self) -> Iterator[None]:
        """The model drafts every timed round: its lookups cost almost nothing, and no prompt
        says how often they will match."""
        self.lookups.enabled = False
        try:
            with self.lookups.no_history(), super().timing():  # type: ignore[misc]
                yield
        finally:
            self.lookups.enabled = True
