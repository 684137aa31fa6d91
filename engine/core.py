"""The engine core: continuous batching and one speculative round per `step(k, rule)`.

A round, for every running sequence at once: plan how many drafts each may take (k, capped by
what it has left), `propose` them with the drafter, cut them by the one `ConfidenceRule`
(engine/confidence.py), `verify` them with one target forward of k+1 tokens, and `accept` the
kept ones (rolling back the target and draft caches) and emit them. New requests are prefilled
and join, and finished ones leave, only between rounds.

Which k and which rule a round runs with are the caller's decisions (engine/controller.py), passed
in. Each k runs with a `RuntimeState` built for it before serving; a round selects one by k, never
building one inside a round.

Only the thread that calls `step()` touches an engine; from other threads, engine/loop.py's
inbox is the one way in.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import deque
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.checkpoint import Checkpoint
from engine.confidence import EVERY_DRAFT, ConfidenceRule
from engine.detokenize import OutputText
from engine.device.backend import Backend, backend_for
from engine.device.graphs import ForwardMode, GraphRunner, GraphSet, default_batch_sizes
from engine.device.prefill import DEFAULT_MAX_TOKENS, PrefillGraphs, eager_prefill
from engine.drafters.base import Drafter, Proposal
from engine.model.transformer import Captured
from engine.request import Request, Sequence, finish_reason
from engine.sampling import SamplingParams, next_token
from engine.verify import CHAIN_RULES, verify


@dataclass
class StateStats:
    """What the rounds run with one runtime state have shown."""

    rounds: int = 0
    tokens: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # proposed_at[j] / accepted_at[j]: drafts at chain position j proposed / kept.
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def observe(self, result: StepResult) -> None:
        """Count what a round run with this state showed."""
        self.rounds += 1
        self.draft_seconds += result.draft_seconds
        self.verify_seconds += result.verify_seconds
        for out in result.outputs:
            if not out.verified:
                continue
            proposed, kept = out.drafts_proposed, out.drafts_accepted
            self.tokens += kept + 1
            self.drafts_proposed += proposed
            self.drafts_accepted += kept
            while len(self.proposed_at) < proposed:
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            for j in range(proposed):
                self.proposed_at[j] += 1
                self.accepted_at[j] += j < kept


@dataclass
class RuntimeState:
    """Everything a round with draft length `k` needs, made before it is ever selected.

    On CPU that is the warmed-up shapes of its verify forward and what its rounds have shown;
    on backends with graphs it also owns its verify graphs (`memory_bytes` is what capturing them
    added). What all states share (the caches, the drafter's step graphs) does not
    depend on k, so no state can outgrow it (SGLang crashed on a shared buffer sized for one tier).
    """

    k: int
    build_seconds: float
    memory_bytes: int
    stats: StateStats = field(default_factory=StateStats)
    graphs: GraphSet | None = None  # verify graphs of width k+1, one per batch-size bucket
    # batch size -> the median seconds of a round, timed before serving (Engine.time_rounds)
    round_seconds: dict[int, float] = field(default_factory=dict)


@dataclass
class SequenceOutput:
    request_id: str
    new_tokens: list[int]
    finish_reason: str | None
    drafts_proposed: int
    drafts_accepted: int
    verified: bool  # took part in the round (False for the first token, from the prefill)


@dataclass
class StepResult:
    round: int
    k: int
    batch_size: int
    outputs: list[SequenceOutput]
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    drafts_trimmed: int = 0  # drafts left unverified because the drafter was unsure of them
    prefill_tokens: int = 0  # prompt tokens prefilled at this round's boundary
    prefill_graphed: bool = False  # whether they ran through prefill graphs (engine/device/prefill.py)
    prefill_fallback: str | None = None  # why not, where prefill graphs exist (a guard's reason)


def rows(hidden: dict[int, Tensor], keep: list[int]) -> dict[int, Tensor]:
    """The captured hidden states of the batch rows `keep`, in that order."""
    first = next(iter(hidden.values()), None)
    if first is None or len(keep) == first.shape[0]:  # nothing captured, or every row goes on
        return hidden
    index = torch.tensor(keep, dtype=torch.long, device=first.device)
    if isinstance(hidden, Captured):
        return hidden.rows(index)
    return {layer: h.index_select(0, index) for layer, h in hidden.items()}


class Engine:
    def __init__(
        self,
        target: Checkpoint,
        drafter: Drafter | None,
        max_batch_size: int,
        max_seq_len: int,
        candidate_k: Iterable[int],
        max_k: int = 8,
        backend: Backend | None = None,
        graphs: bool = True,
        graph_batch_sizes: Iterable[int] | None = None,
        verification: str = "block",
        prefill_graph_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        if verification not in CHAIN_RULES:
            raise ValueError(f"unknown verification {verification!r}: expected one of {', '.join(CHAIN_RULES)}")
        self.target = target
        self.verification = verification  # how sampled chains are judged (engine/verify.py)
        self.model = target.model
        self.drafter = drafter
        # The target layers whose outputs every prefill and verify hand to the drafter.
        self.capture_layers: tuple[int, ...] = tuple(drafter.capture_layers) if drafter is not None else ()
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_k = max_k
        self.cache = self.model.new_cache(max_batch_size, max_seq_len)
        self.backend = backend or backend_for(self.model.device)
        if drafter is not None:
            drafter.samples_on_device = self.backend.samples_on_device
        self.graph_runner: GraphRunner | None = None
        if graphs and self.backend.supports_graphs:
            sizes = list(graph_batch_sizes or default_batch_sizes(max_batch_size))
            self.graph_runner = GraphRunner(self.model, self.cache, self.backend, sizes)
        # Prompts through piecewise graphs, where the backend allows them (it says why not).
        self.prefill_graphs: PrefillGraphs | None = None
        most = min(prefill_graph_tokens, max_batch_size * max_seq_len)
        if self.graph_runner is not None and eager_prefill(self.backend, most) is None:
            self.prefill_graphs = PrefillGraphs(
                self.model, self.cache, self.backend, most, max_batch_size, self.capture_layers
            )
        self.round = 0
        self.running: list[Sequence] = []
        self.waiting: deque[Request] = deque()
        self.cancelled: set[str] = set()  # request ids dropped at the next boundary
        self.states: dict[int, RuntimeState] = {}
        for k in sorted(set(candidate_k)):
            self.build_state(k)
        if not self.states:
            raise ValueError("at least one candidate draft length is needed")

    # ---- runtime states -------------------------------------------------------------------

    def build_state(self, k: int) -> RuntimeState:
        """Build the state for `k`, between rounds: its warm-up and graph capture use the device,
        and would be timed into a round running beside them."""
        if not 0 <= k <= self.max_k:
            raise ValueError(f"draft length {k} is outside 0..{self.max_k}")
        if k > 0 and self.drafter is None:
            raise ValueError(f"draft length {k} needs a drafter; this engine has none")
        if k in self.states:
            return self.states[k]
        started = time.perf_counter()
        graphs, memory = None, 0
        self._warm_up_verify(k)
        if self.graph_runner is not None:
            # State k's verify graphs, and whatever the drafter captures for k (it owns those).
            graphs = self.graph_runner.capture(ForwardMode.VERIFY, [k + 1], self.capture_layers)
            memory = graphs.memory_bytes
            if self.drafter is not None:
                memory += self.drafter.capture(k, self.backend, self.graph_runner.batch_sizes)
        state = RuntimeState(k=k, build_seconds=time.perf_counter() - started, memory_bytes=memory, graphs=graphs)
        self.states[k] = state
        return state

    def state(self, k: int) -> RuntimeState:
        """The built state for `k` (a round selects it by this lookup: a reference, nothing built)."""
        state = self.states.get(k)
        if state is None:
            raise KeyError(f"no runtime state for draft length {k}; built: {sorted(self.states)}")
        return state

    @property
    def graph_captures(self) -> int:
        """Graphs captured so far: only building a state adds to it, never selecting one."""
        target = self.graph_runner.captures if self.graph_runner is not None else 0
        target += self.prefill_graphs.captures if self.prefill_graphs is not None else 0
        return target + (self.drafter.graph_captures if self.drafter is not None else 0)

    @torch.inference_mode()
    def _warm_up_verify(self, k: int) -> None:
        """Run this state's verify shape once at batch 1 and at the largest batch, on a scratch cache."""
        scratch = self.model.new_cache(self.max_batch_size, k + 2)
        for batch_size in sorted({1, self.max_batch_size}):
            slots = list(range(batch_size))
            for slot in slots:
                scratch.lengths[slot] = 0
            tokens = [[0] * (k + 1)] * batch_size
            self.model(self.model.batch(scratch, slots, tokens), scratch)

    @property
    def profile(self) -> dict[tuple[int, int], float]:
        """(k, batch size) -> a round's seconds, where `time_rounds` timed them before serving."""
        return {(k, b): seconds for k, state in self.states.items() for b, seconds in state.round_seconds.items()}

    @torch.inference_mode()
    def time_rounds(
        self, batch_sizes: Iterable[int], rounds: int = 8, context: int = 256
    ) -> dict[tuple[int, int], float]:
        """The median seconds of a round at every built state and each batch size, timed before
        serving, as (k, batch size) -> seconds; each state keeps its own (`round_seconds`).

        At each batch size the same greedy sequences (a fixed prompt of `context` tokens) run a
        round at every k in turn, `rounds` times over, so that every k is timed on the same
        contexts and any drift of the machine's speed falls on all of them alike. Between rounds
        only, with nothing running: what the timed requests leave behind (round count, each
        state's stats, the drafter's lookups: `Drafter.timing`) is put back."""
        if self.has_work:
            raise RuntimeError("time_rounds needs an idle engine")
        saved_round = self.round
        saved_stats = {k: copy.deepcopy(state.stats) for k, state in self.states.items()}
        # Any tokens: a round costs the same whatever they say.
        vocab, length = self.model.config.vocab_size, min(context, self.max_seq_len // 2)
        prompt = tuple((16 + i) % vocab for i in range(length))
        order = sorted(self.states)
        longest = sum(k + 1 for k in order) * (rounds + 1) + 1
        params = SamplingParams(max_tokens=max(1, min(self.max_seq_len - length, longest)), ignore_eos=True)
        seconds: dict[tuple[int, int], float] = {}
        try:
            with self.drafter.timing() if self.drafter is not None else nullcontext():
                for batch_size in sorted({min(b, self.max_batch_size) for b in batch_sizes}):
                    times = self._time_batch(batch_size, prompt, params, order, rounds)
                    for k, taken in times.items():
                        if taken:
                            seconds[k, batch_size] = self.states[k].round_seconds[batch_size] = statistics.median(taken)
        finally:
            self.round = saved_round
            for k, state in self.states.items():
                state.stats = saved_stats[k]
        return seconds

    def _time_batch(
        self, batch_size: int, prompt: tuple[int, ...], params: SamplingParams, order: list[int], rounds: int
    ) -> dict[int, list[float]]:
        """Each k's round seconds at one batch size (`time_rounds`)."""
        times: dict[int, list[float]] = {k: [] for k in order}
        after_zero = False
        for turn in range(2 * (rounds + 1)):
            if min(len(taken) for taken in times.values()) >= rounds:
                break
            if not self.running:  # new sequences: a short max_seq_len ends them early
                for _ in range(batch_size):
                    self.add_request(Request(prompt, params))
                # Their prefill, and a round at the longest k that warms the shapes: the next
                # timed round follows it, so it must not be k = 0's (the drafter would catch up).
                self.step(order[-1])
                after_zero = order[-1] == 0
            # Each turn starts at another k, so that every k gets rounds before the sequences
            # end; a round after k = 0 is not timed (the drafter catches up).
            for k in order[turn % len(order) :] + order[: turn % len(order)]:
                started = time.perf_counter()
                result = self.step(k)
                if result.batch_size == batch_size and not after_zero:
                    times[k].append(time.perf_counter() - started)
                after_zero = k == 0
        for seq in self.running:
            self.cancel(seq.request.id)
        while self.has_work:
            self.step(order[0])
        return times

    # ---- requests ------------------------------------------------------------------------

    def check_request(self, request: Request) -> None:
        """Raise ValueError naming what is wrong with a request this engine cannot serve (reads
        only what never changes: safe from any thread)."""
        if not request.prompt:
            raise ValueError("the prompt is empty")
        total = len(request.prompt) + request.params.max_tokens
        if total > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.params.max_tokens}) "
                f"exceeds max_seq_len {self.max_seq_len}"
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt):
            raise ValueError(f"prompt has token ids outside the vocabulary (0..{vocab - 1})")

    def add_request(self, request: Request) -> None:
        """Check a request and queue it; it joins the batch at the next boundary."""
        self.check_request(request)
        self.enqueue(request)

    def enqueue(self, request: Request) -> None:
        """Queue a request already checked (`check_request`, at submit on another thread)."""
        self.waiting.append(request)

    def cancel(self, request_id: str) -> None:
        """Drop a request at the next boundary: its last output says "cancelled"."""
        self.cancelled.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.cancelled)

    # ---- the round -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, k: int, rule: ConfidenceRule = EVERY_DRAFT, row_ks: Mapping[str, int] | None = None) -> StepResult:
        """One boundary (cancel, admit), then one round with the state of draft length `k`, whose
        drafts `rule` cuts. `row_ks` gives a request its own draft length (at most k; one left out,
        as every request joining at this boundary, drafts k): one verify holds chains of them all."""
        state = self.state(k)
        outputs: dict[str, SequenceOutput] = {}
        self._apply_cancellations(outputs)
        result = StepResult(self.round, k, 0, [])
        started = time.perf_counter()
        self._admit(outputs, result)
        result.prefill_seconds = time.perf_counter() - started
        seqs = [s for s in self.running if s.finish_reason is None]
        if seqs:
            started = time.perf_counter()
            # Plan: each row's k, never past max_tokens (the target's own token always follows the drafts).
            planned = row_ks or {}
            ks = [max(0, min(planned.get(seq.request.id, k), k, seq.remaining - 1)) for seq in seqs]
            # Propose: a chain drafter stops where the rule would cut it; a block is cut here.
            if max(ks, default=0) > 0 and self.drafter is not None:
                proposals = self.drafter.propose(seqs, ks, rule)
            else:
                proposals = [Proposal([]) for _ in seqs]
            for proposal in proposals:
                proposal.cut(rule)
            drafted = time.perf_counter()
            # Verify: one target forward over each sequence's pending token and its drafts.
            emitted, hidden = self.verify(seqs, proposals, state)
            verified = time.perf_counter()
            # Accept: emit the kept drafts and the target's token; the caches forget the rest.
            self.accept(seqs, proposals, emitted, hidden, outputs)
            result.batch_size = len(seqs)
            result.draft_seconds, result.verify_seconds = drafted - started, verified - drafted
            result.drafts_trimmed = sum(p.trimmed for p in proposals)
            self.round += 1
        self._retire()
        result.outputs = list(outputs.values())
        if seqs:
            state.stats.observe(result)
        return result

    def verify(
        self, seqs: Seq[Sequence], proposals: Seq[Proposal], state: RuntimeState | None = None
    ) -> tuple[list[list[int]], dict]:
        """One target forward over each pending token and its drafts: through `state`'s graphs
        when the batch fits one, else eagerly."""
        slots = [s.slot for s in seqs]
        tokens = [[s.tokens[-1], *p.tokens] for s, p in zip(seqs, proposals)]
        out = None
        if state is not None and state.graphs is not None:
            out = state.graphs.run(ForwardMode.VERIFY, slots, tokens, self.capture_layers)
        if out is None:
            batch = self.model.batch(self.cache, slots, tokens)
            out = self.model(batch, self.cache, capture=self.capture_layers)
        emitted = verify(out.logits, seqs, proposals, self.verification, out.argmax, self.backend.samples_on_device)
        return emitted, out.hidden

    def accept(
        self,
        seqs: Seq[Sequence],
        proposals: Seq[Proposal],
        emitted: Seq[list[int]],
        hidden: dict,
        outputs: dict[str, SequenceOutput],
    ) -> None:
        accepted = []
        for seq, proposal, tokens in zip(seqs, proposals, emitted):
            kept = len(tokens) - 1
            new = self._append(seq, tokens)
            # The target cache keeps every emitted token but the newest (fed next round).
            self.cache.truncate(seq.slot, min(self.cache.lengths[seq.slot], len(seq.tokens) - 1))
            # A sequence admitted at this boundary already emitted its first token from the prefill.
            admitted = outputs.get(seq.request.id)
            if admitted is not None:
                new = admitted.new_tokens + new
            outputs[seq.request.id] = SequenceOutput(
                seq.request.id,
                new,
                seq.finish_reason,
                len(proposal.tokens),
                kept,
                verified=True,
            )
            accepted.append(kept)
        if self.drafter is not None:
            live = [row for row, s in enumerate(seqs) if s.finish_reason is None]
            self.drafter.accept([seqs[row] for row in live], [accepted[row] for row in live], rows(hidden, live))

    def _append(self, seq: Sequence, tokens: Seq[int]) -> list[int]:
        """Emit tokens one by one, stopping exactly where target-only decoding would."""
        new = []
        eos = self.target.eos_token_ids
        for token in tokens:
            seq.output.append(token)
            seq.tokens.append(token)
            new.append(token)
            if seq.text is not None:
                seq.text.push([token])
            seq.finish_reason = finish_reason(seq.output, seq.params, eos, seq.text)
            if seq.finish_reason is not None:
                break
        return new

    # ---- boundaries ----------------------------------------------------------------------

    def _admit(self, outputs: dict[str, SequenceOutput], result: StepResult) -> None:
        admitted: list[Sequence] = []
        while self.waiting and self.cache.free_slots:
            request = self.waiting.popleft()
            seq = Sequence(
                request=request,
                slot=self.cache.allocate(),
                generator=request.params.generator(self.model.device),
                tokens=list(request.prompt),
                text=OutputText(self.target.tokenizer, request.params.stop) if request.params.stop else None,
            )
            admitted.append(seq)
        if not admitted:
            return
        slots, prompts = [s.slot for s in admitted], [s.tokens for s in admitted]
        result.prefill_tokens = sum(len(prompt) for prompt in prompts)
        out = None
        if self.prefill_graphs is not None:
            out = self.prefill_graphs.run(slots, prompts, self.capture_layers)
            result.prefill_graphed = out is not None
            if out is None:
                result.prefill_fallback = self.prefill_graphs.refusal(slots, prompts, self.capture_layers)
        if out is None:
            out = self.model(self.model.batch(self.cache, slots, prompts), self.cache, True, self.capture_layers)
        logits = out.logits[:, -1]
        for row, seq in enumerate(admitted):
            new = self._append(seq, [next_token(logits[row], seq.params, seq.generator)])
            outputs[seq.request.id] = SequenceOutput(seq.request.id, new, seq.finish_reason, 0, 0, verified=False)
        self.running.extend(admitted)
        if self.drafter is not None:
            live = [row for row, s in enumerate(admitted) if s.finish_reason is None]
            self.drafter.admit([admitted[row] for row in live], rows(out.hidden, live))

    def _apply_cancellations(self, outputs: dict[str, SequenceOutput]) -> None:
        if not self.cancelled:
            return  # the common case: every round passes here
        cancelled, self.cancelled = self.cancelled, set()
        for request in [r for r in self.waiting if r.id in cancelled]:
            self.waiting.remove(request)
            outputs[request.id] = SequenceOutput(request.id, [], "cancelled", 0, 0, verified=False)
        for seq in self.running:
            if seq.request.id in cancelled and seq.finish_reason is None:
                seq.finish_reason = "cancelled"
                outputs[seq.request.id] = SequenceOutput(seq.request.id, [], "cancelled", 0, 0, verified=False)

    def _retire(self) -> None:
        still = []
        for seq in self.running:
            if seq.finish_reason is None:
                still.append(seq)
                continue
            self.cache.release(seq.slot)
            if self.drafter is not None:
                self.drafter.release(seq)
        self.running = still

    def run_until_done(
        self, requests: Iterable[Request], k: int | None = None, rule: ConfidenceRule = EVERY_DRAFT
    ) -> dict[str, list[int]]:
        """Serve `requests` to completion at draft length `k` (the longest built if None), for
        tests and benchmarks; returns each one's output tokens."""
        k = max(self.states) if k is None else k
        outputs: dict[str, list[int]] = {}
        for request in requests:
            self.add_request(request)
            outputs[request.id] = []
        while self.has_work:
            for out in self.step(k, rule).outputs:
                outputs[out.request_id].extend(out.new_tokens)
        return outputs
