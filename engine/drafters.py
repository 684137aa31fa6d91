"""Drafters: they propose up to k tokens per sequence, and forget the ones the target rejects.

Every drafter follows the same protocol, so the engine never asks which one it holds:

- `admit(seqs, hidden)`: new sequences joined (their prompts are in `seq.tokens`; `hidden` holds
  the prefill's hidden states at `capture_layers`, a row per sequence);
- `propose(seqs, ks, floor)`: up to `ks[i]` draft tokens for sequence i, with the drafter's
  probabilities for each (None means the proposal is deterministic: a one-hot distribution); a
  drafter that drafts a step at a time and knows how sure it is of each draft may stop a chain
  at a draft it is less sure of than `floor` (0: never), saying how many it left out;
- `accept(seqs, accepted, hidden)`: after verification, `accepted[i]` drafts of sequence i were
  kept and `seq.tokens` already holds them plus the target's token; roll back the rest;
- `release(seq)`: the sequence left.

`capture_layers` names the target layers whose hidden states the drafter reads from the last
verify (EAGLE- and DFlash-style drafters); the draft-model and n-gram drafters need none.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from engine.checkpoint import Checkpoint
from engine.config import CheckpointError, weight_shapes
from engine.graphs import ForwardMode, GraphSet
from engine.kv_cache import KVCache
from engine.model import Transformer
from engine.native import NativeForward
from engine.request import Sequence
from engine.sampling import sample, target_probs


@dataclass
class Proposal:
    tokens: list[int]
    probs: Tensor | None = None  # [len(tokens), V] the drafter's distribution, or None if one-hot
    # How sure the drafter is of each position, where it knows before the target looks (a drafter
    # that drafts a whole block in one forward): its largest probability there, what a round may
    # trim by. Never the probability of the sampled draft itself: a sampled draft dropped for its
    # own value would bend the distribution the target's rejection rule corrects.
    confidence: list[float] | None = None
    trimmed: int = 0  # drafts left out because the drafter was unsure of them

    def confident_drafts(self, floor: float) -> int:
        """How many leading drafts keep the running product of their confidences at or above
        `floor` (every draft where the drafter gave none)."""
        if self.confidence is None or floor <= 0:
            return len(self.tokens)
        chance = 1.0
        for j, c in enumerate(self.confidence):
            chance *= c
            if chance < floor:
                return j
        return len(self.tokens)

    def keep(self, count: int) -> None:
        """Only the first `count` drafts are verified. Lossless whatever the count, since it is
        chosen before the target sees any of them."""
        self.trimmed += max(0, len(self.tokens) - count)
        self.tokens = self.tokens[:count]
        if self.probs is not None:
            self.probs = self.probs[:count]
        if self.confidence is not None:
            self.confidence = self.confidence[:count]


def stored_weights(file: Path) -> dict[str, Tensor]:
    """A drafter's weights file as meta tensors of the stored shapes, read from its header alone:
    what `check_weights` compares against a model without loading anything."""
    return {name: torch.empty(shape, device="meta") for name, shape in weight_shapes(file).items()}


class DraftVocabulary:
    """A feature drafter's own vocabulary, a subset of the target's where the checkpoint has
    `d2t` (draft id d is target id d + d2t[d], as SpecForge writes it): a head over the frequent
    ids costs a fraction of one over the whole vocabulary. Mixed into the drafters' nn.Modules."""

    config: Any  # with vocab_size and draft_vocab_size
    fc: nn.Linear
    d2t: Tensor

    def draft_to_target(self) -> Tensor:
        ids = torch.arange(self.config.draft_vocab_size, device=self.fc.weight.device)
        return ids + self.d2t if self.config.draft_vocab_size < self.config.vocab_size else ids

    @staticmethod
    def check_map(source: Path, state: dict[str, Tensor], draft_vocab_size: int, vocab_size: int) -> None:
        """A checkpoint's d2t (in `state`, read from `source`): every draft id maps into the target's vocabulary."""
        if "d2t" in state:
            ids = torch.arange(draft_vocab_size) + state["d2t"].long()
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise CheckpointError(f"{source}: d2t maps draft ids outside the vocabulary (0..{vocab_size - 1})")

    def full_vocabulary(self, logits: Tensor) -> Tensor:
        """Draft-vocabulary logits placed in the target's vocabulary, the ids outside at -inf."""
        if logits.shape[-1] == self.config.vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.draft_to_target(), logits)

    def full_probabilities(self, probs: Tensor, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary probabilities placed in the target's vocabulary (`draft_ids`, the
        drafter's `draft_to_target()`), where the rejection rule reads them; zero outside. A
        draft is drawn over the draft vocabulary, a quarter of the target's or less."""
        if probs.shape[-1] == self.config.vocab_size:
            return probs
        return probs.new_zeros((*probs.shape[:-1], self.config.vocab_size)).index_copy_(-1, draft_ids, probs)


class Drafter(Protocol):
    name: str
    capture_layers: tuple[int, ...]

    def admit(self, seqs: Seq[Sequence], hidden: dict[int, Tensor]) -> None: ...

    def propose(self, seqs: Seq[Sequence], ks: Seq[int], floor: float = 0.0) -> list[Proposal]: ...

    def accept(self, seqs: Seq[Sequence], accepted: Seq[int], hidden: dict[int, Tensor]) -> None: ...

    def release(self, seq: Sequence) -> None: ...


class Int8Linear(nn.Module):
    """A linear layer with int8 weights whose input is quantized on the fly (fbgemm's dynamic int8
    kernel, per-tensor weights as torch.ao's default dynamic qconfig makes them), calling the
    kernel directly: torch.ao's module spends about 3.5 us of Python around a 10.6 us call (256 to
    512 features, one row), and a draft step of the default draft model makes nine such calls."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        plain = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        plain.load_state_dict(linear.state_dict())
        plain.qconfig = torch.ao.quantization.default_dynamic_qconfig
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization points to torchao; it still works
            quantized = torch.ao.nn.quantized.dynamic.Linear.from_float(plain)
        self.packed_params = quantized._packed_params._packed_params

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic.default(x, self.packed_params, True)


def int8_linears(model: Transformer) -> Transformer:
    """`model` with its linear layers' weights in int8: on the compiled CPU kernels, a view of it
    whose forward reads int8 copies (widened as they are read); else a copy whose linear layers run
    with PyTorch's dynamic int8 quantization."""
    if model.native is not None:
        view = copy.copy(model)  # the parameters are shared; only the forward's copies differ
        view.native = NativeForward(model, model.native.lib, linears=torch.int8)
        return view
    quantized = Transformer(model.config, model.max_positions)
    quantized.load_state_dict(model.state_dict())
    quantized.eval().requires_grad_(False)
    for parent in list(quantized.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
    return quantized


class DraftModelDrafter:
    """A smaller model with the target's tokenizer and its own KV cache.

    Its cache holds a prefix of `seq.tokens`; whatever it lacks (the target's last token, and the
    last draft when every draft was accepted) is fed at the start of the next proposal.
    """

    name = "draft_model"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, draft: Checkpoint, max_batch_size: int, max_seq_len: int, quantize: bool = False) -> None:
        self.checkpoint = draft
        # On CPU a draft step streams the draft's weights from memory (the target's evict them
        # from cache every round): int8 weights are half the bytes of bfloat16. The draft's
        # precision only moves the acceptance rate; the target verifies every token.
        self.model = int8_linears(draft.model) if quantize and draft.device.type == "cpu" else draft.model
        self.cache: KVCache = self.model.new_cache(max_batch_size, max_seq_len)
        # Decode-step graphs, shared by every runtime state; set by the engine where the backend has graphs.
        self.graphs: GraphSet | None = None

    def admit(self, seqs: Seq[Sequence], hidden: dict[int, Tensor] | None = None) -> None:
        # The prompt is fed at the first proposal, with whatever else the cache lacks: a request
        # served at k = 0 throughout never runs the draft model.
        for seq in seqs:
            seq.draft_slot = self.cache.allocate()

    def _forward(
        self, seqs: Seq[Sequence], inputs: Seq[Seq[int]], mode: ForwardMode = ForwardMode.PREFILL
    ) -> Tensor | None:
        rows = [(seq, tokens) for seq, tokens in zip(seqs, inputs) if tokens]
        if not rows:
            return None
        slots = [seq.draft_slot for seq, _ in rows]
        tokens = [t for _, t in rows]
        out = self.graphs.run(mode, slots, tokens) if self.graphs is not None else None
        if out is None:
            batch = self.model.batch(self.cache, slots, tokens)
            out = self.model(batch, self.cache, last_only=True)
        return out.logits[:, -1]

    def propose(self, seqs: Seq[Sequence], ks: Seq[int], floor: float = 0.0) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        probs: list[list[Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        inputs = {i: seqs[i].tokens[self.cache.lengths[seqs[i].draft_slot] :] for i in active}
        native = self.model.native if self.graphs is None else None
        if native is not None:
            # Greedy chains run whole in the kernels: a forward from Python costs a third again of its arithmetic.
            greedy = [i for i in active if seqs[i].params.greedy]
            if greedy:
                slots, fed = [seqs[i].draft_slot for i in greedy], [inputs[i] for i in greedy]
                for i, tokens in zip(greedy, native.greedy_chain(self.cache, slots, fed, [ks[i] for i in greedy])):
                    proposals[i].tokens = tokens
            active = [i for i in active if not seqs[i].params.greedy]
        while active:
            logits = self._forward([seqs[i] for i in active], [inputs[i] for i in active], ForwardMode.DRAFT)
            greedy_rows = logits.argmax(dim=-1).tolist()
            for row, i in enumerate(active):
                seq = seqs[i]
                if seq.params.greedy:
                    token = greedy_rows[row]
                else:
                    q = target_probs(logits[row], seq.params)
                    token = sample(q, seq.generator)
                    probs[i].append(q)
                proposals[i].tokens.append(token)
                inputs[i] = [token]
            active = [i for i in active if len(proposals[i].tokens) < ks[i]]
        for i, q in enumerate(probs):
            if q:
                proposals[i].probs = torch.stack(q)
        return proposals

    def accept(self, seqs: Seq[Sequence], accepted: Seq[int], hidden: dict[int, Tensor]) -> None:
        for seq in seqs:
            # Everything in the draft cache up to the target's newest token is now confirmed.
            keep = min(self.cache.lengths[seq.draft_slot], len(seq.tokens) - 1)
            self.cache.truncate(seq.draft_slot, keep)

    def release(self, seq: Sequence) -> None:
        if seq.draft_slot is not None:
            self.cache.release(seq.draft_slot)
            seq.draft_slot = None


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
        for key, start in self._ngrams(text):
            self.starts[key] = (number, start)
        while self.size > self.capacity:
            self._forget(next(iter(self.texts)))

    def _forget(self, number: int) -> None:
        text = self.texts.pop(number)
        self.size -= len(text)
        for key, start in self._ngrams(text):
            if self.starts.get(key) == (number, start):
                del self.starts[key]

    def _ngrams(self, text: tuple[int, ...]) -> Iterator[tuple[int, int]]:
        """The hash and start of each indexed n-gram of `text` that has a token after it."""
        for n in self.spans:
            for start in range(len(text) - n):
                yield hash(text[start : start + n]), start

    def continuation(self, tokens: Seq[int], k: int) -> tuple[list[int], int]:
        """What followed the latest occurrence of the context's longest indexed suffix in an
        earlier sequence (at most k tokens), and how many tokens matched; empty and 0 if none."""
        for n in self.spans:
            if n > len(tokens):
                continue
            suffix = tuple(tokens[len(tokens) - n :])
            hit = self.starts.get(hash(suffix))
            if hit is None:
                continue
            number, start = hit
            text = self.texts[number]
            if text[start : start + n] == suffix:
                end = start + n
                return list(text[end : end + k]), matched(tokens, text, end)
        return [], 0


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (longest n
    first, from max_n down to min_n) and propose what followed it. No weights and no KV cache:
    each sequence gets an index of its n-grams, so a lookup does not scan the context (a
    1,500-token context with no match took 96 us to scan, 2.3 us to look up). With a
    `LookupHistory`, earlier sequences are looked in too, and the longer match wins.

    """

    name = "ngram"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, min_n: int = 1, max_n: int = 4, history: int = 0) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[Sequence, NgramIndex] = {}
        self.history = LookupHistory(history) if history > 0 else None
        self.enabled = True  # False while the engine times what a hybrid's model costs

    def admit(self, seqs: Seq[Sequence], hidden: dict[int, Tensor] | None = None) -> None:
        for seq in seqs:
            self.indexes[seq] = NgramIndex(self.min_n, self.max_n)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int], floor: float = 0.0) -> list[Proposal]:
        # Deterministic: the drafter's distribution is one-hot.
        return [Proposal(self.lookup(seq, k)[0]) for seq, k in zip(seqs, ks)]

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

    def accept(self, seqs: Seq[Sequence], accepted: Seq[int], hidden: dict[int, Tensor]) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        if self.indexes.pop(seq, None) is not None and self.history is not None:
            self.history.add(seq.tokens)


class LookupFirst:
    """Prompt lookup in front of a model drafter (a mixin listed before the drafter's class, whose
    arguments it passes on; it takes the lookups' own as keywords): a greedy sequence whose context
    has seen its last n-grams before proposes what followed them, at no model cost; sequences
    without a match, and every sampled one, draft with the model. A deterministic draft x of a
    sampled sequence is kept with probability p(x) only, and at temperature 1 the lookups gained
    nothing."""

    def __init__(self, *args: Any, min_n: int = 1, max_n: int = 4, history: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lookups = NgramDrafter(min_n, max_n, history)

    def admit(self, seqs: Seq[Sequence], hidden: dict[int, Tensor] | None = None) -> None:
        super().admit(seqs, hidden)  # type: ignore[misc]
        self.lookups.admit(seqs)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int], floor: float = 0.0) -> list[Proposal]:
        found = self.lookups.propose(seqs, [k if seq.params.greedy else 0 for seq, k in zip(seqs, ks)])
        rest = [0 if lookup.tokens else k for lookup, k in zip(found, ks)]
        drafted = super().propose(seqs, rest, floor)  # type: ignore[misc]
        return [lookup if lookup.tokens else proposal for lookup, proposal in zip(found, drafted)]

    def release(self, seq: Sequence) -> None:
        super().release(seq)  # type: ignore[misc]
        self.lookups.release(seq)


class HybridDrafter(LookupFirst, DraftModelDrafter):
    """Prompt lookup in front of the draft model (`LookupFirst`). Text that repeats itself
    (boilerplate, code restating its own names) gets long chains for the price of verifying them:
    a lookup takes about 2 us, a draft step of the default int8 draft about 0.47 ms. The draft
    model's cache catches up on what the lookups proposed at its next step."""

    name = "hybrid"


def make_drafter(
    kind: str,
    draft: Checkpoint | None,
    max_batch_size: int,
    max_seq_len: int,
    quantize: bool = True,
    ngram_min: int = 1,
    ngram_max: int = 4,
    lookup_history: int = 0,
) -> Drafter | None:
    """The drafter `kind` names ("draft_model", "hybrid", "ngram" or "none"), as [engine] sets it up."""
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(ngram_min, ngram_max, lookup_history)
    if draft is None:
        raise ValueError(f"drafter {kind!r} needs a draft model")
    if kind == "draft_model":
        return DraftModelDrafter(draft, max_batch_size, max_seq_len, quantize)
    if kind == "hybrid":
        return HybridDrafter(
            draft, max_batch_size, max_seq_len, quantize, min_n=ngram_min, max_n=ngram_max, history=lookup_history
        )
    raise ValueError(f"unknown drafter {kind!r}: expected draft_model, hybrid, ngram or none")
