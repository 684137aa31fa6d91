"""The EAGLE-3 head drafting: lossless at every k and under switching, its chains stopped by a
confidence floor, its cache in step with the target, its compiled chains and rounds equal to the
step-by-step ones. Its checkpoints, config and benches: test_eagle3_checkpoints.py; its training
script: test_eagle3_training.py."""

from __future__ import annotations

import re
import sys
from dataclasses import replace

import pytest
import torch

from daemon.metrics import Metrics
from engine.confidence import EVERY_DRAFT, ConfidenceRule
from engine.core import Engine, StepResult
from engine.drafters import eagle3 as eagle3_drafting
from engine.drafters.base import Proposal
from engine.drafters.eagle3 import Eagle3Drafter, Extend, HybridEagle3Drafter
from engine.generate import generate
from engine.model.config import Eagle3Config, eagle3_taps
from engine.model.eagle3 import Eagle3Model
from engine.request import Request, Sequence
from engine.sampling import SamplingParams
from tests.conftest import ROOT
from tests.test_dflash import serve_switching
from tests.test_speculative import MAX_SEQ_LEN, PROMPTS, assert_follows_marginals, exact_marginals


def head_for(
    target,
    draft_vocab: int | None = None,
    seed: int = 0,
    taps: tuple[int, ...] | None = None,
    norm_before_residual: bool = False,
    window: int | None = None,
) -> Eagle3Model:
    """An untrained head shaped for `target` (its drafts mostly wrong: every kind of rejection
    happens), with a reduced draft vocabulary of `draft_vocab` ids if given."""
    tc = target.config
    config = Eagle3Config(
        hidden_size=tc.hidden_size,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=tc.vocab_size,
        draft_vocab_size=draft_vocab or tc.vocab_size,
        target_hidden_size=tc.hidden_size,
        target_layer_ids=taps,
        rms_norm_eps=tc.rms_norm_eps,
        norm_before_residual=norm_before_residual,
        sliding_window=window,
    )
    torch.manual_seed(seed)
    model = Eagle3Model(config, eagle3_taps(config, tc))
    for param in model.parameters():
        if param.dim() > 1:
            param.data.normal_(0, 0.2)
    if draft_vocab:  # every other id, from the top: the maps are not the identity
        ids = torch.arange(tc.vocab_size - 1, -1, -2)[:draft_vocab].sort().values
        model.d2t.copy_(ids - torch.arange(draft_vocab))
        model.t2d.zero_()
        model.t2d[ids] = True
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def trained_head(pair) -> Eagle3Model:
    """A head trained a few seconds on the target's own greedy continuations of the test prompts,
    with the training script's loss: it keeps some drafts and loses others, so rounds end in every
    way (all kept, some, none)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_eagle3 import target_outputs, ttt_loss

    target, _ = pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    tokens = torch.tensor([(p + c.tokens)[:42] for p, c in zip(PROMPTS, generate(target, PROMPTS, params))])
    head = head_for(target.model, taps=(0, 1, 1)).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    taps, log_p = target_outputs(head, target.model, tokens)
    for _ in range(120):
        loss, _ = ttt_loss(head, target.model, tokens, taps, log_p, 16, 4, 0.8, generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval().requires_grad_(False)


def windowed(head: Eagle3Model, window: int | None) -> Eagle3Model:
    """The same head attending to at most `window` positions."""
    twin = Eagle3Model(replace(head.config, sliding_window=window), head.taps)
    twin.load_state_dict(head.state_dict())
    return twin.eval().requires_grad_(False)


def engine_for(target, batch: int, ks=(0, 1, 2, 3, 5), **head) -> Engine:
    drafter = Eagle3Drafter(head_for(target.model, **head), target.model, batch, MAX_SEQ_LEN)
    return Engine(target, drafter, batch, MAX_SEQ_LEN, ks)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_target_only_for_every_k(pair, batch):
    target, _ = pair
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = PROMPTS[:batch]
    expected = [c.tokens for c in generate(target, prompts, params)]
    for k in (0, 1, 2, 3, 5, 8):
        engine = engine_for(target, batch, (k,))
        requests = [Request(tuple(p), params) for p in prompts]
        outputs = engine.run_until_done(requests, k)
        assert [outputs[r.id] for r in requests] == expected, f"k={k}"
        if k:
            assert engine.states[k].stats.drafts_proposed > 0


@pytest.mark.parametrize(
    "trained, quantize, window", [(False, False, None), (True, False, None), (True, True, None), (True, False, 6)]
)
def test_greedy_stays_lossless_when_k_changes_at_every_boundary(pair, trained_head, trained, quantize, window):
    target, _ = pair
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    head = trained_head if trained else head_for(target.model)
    if window:  # shorter than the longer prompts and than every request: the window moves along
        head = windowed(head, window)
    drafter = Eagle3Drafter(head, target.model, 4, MAX_SEQ_LEN, quantize=quantize)
    assert drafter.native is not None and drafter.native.weights.linears == (torch.int8 if quantize else torch.bfloat16)
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, (0, 1, 2, 3, 5))
    assert serve_switching(engine, params, seed=2) == expected
    proposed = sum(state.stats.drafts_proposed for state in engine.states.values())
    accepted = sum(state.stats.drafts_accepted for state in engine.states.values())
    assert proposed > 0
    if trained:
        assert 0 < accepted < proposed  # kept some, rejected others


@pytest.mark.parametrize("kind", [Eagle3Drafter, HybridEagle3Drafter])
@pytest.mark.parametrize("native", [True, False], ids=["kernels", "pytorch"])
def test_a_confidence_floor_stops_chains_early_and_stays_lossless(pair, trained_head, kind, native, monkeypatch):
    """While the policy adapts (a ConfidenceRule passed to each round), the head's greedy chains
    stop at a draft it is unsure of: rounds verify fewer drafts than k, the metric counts the drafts left
    out, and the output is target-only's with k changed at random every round."""
    target, _ = pair
    if native and target.model.native is None:
        pytest.skip("no compiled kernels here")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    if not native:
        monkeypatch.setattr(eagle3_drafting, "available", lambda *args: False)
    drafter = kind(trained_head, target.model, 4, MAX_SEQ_LEN)
    assert (drafter.native is not None) == native
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, (0, 1, 2, 3, 5))
    metrics, step = Metrics(max_k=5), engine.step

    def observed(k: int, rule: ConfidenceRule = EVERY_DRAFT) -> StepResult:
        assert rule.floor == 0.1
        result = step(k, rule)
        metrics.observe_step(result)
        return result

    engine.step = observed  # type: ignore[method-assign]
    assert serve_switching(engine, params, seed=3, rule=ConfidenceRule(0.1)) == expected
    trimmed = re.search(r"^adaspec_trimmed_drafts_total (\S+)$", metrics.exposition().decode(), re.M)
    assert trimmed and float(trimmed.group(1)) > 0
    assert sum(state.stats.drafts_proposed for state in engine.states.values()) > 0


def test_lookups_in_front_of_the_head_stay_lossless_and_spare_its_steps(pair, trained_head):
    """hybrid_eagle3: lookups propose where the context has seen the last tokens, the head
    elsewhere, catching up on the rounds the lookups proposed; k changed at random every round."""
    target, _ = pair
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    drafter = HybridEagle3Drafter(trained_head, target.model, 4, MAX_SEQ_LEN)
    chains, lookups = [], []
    take_held, lookup = drafter.take_held, drafter.lookups.propose
    drafter.take_held = lambda seqs: chains.append(len(seqs)) or take_held(seqs)  # type: ignore[method-assign]
    drafter.lookups.propose = lambda *args: lookups.append(lookup(*args)) or lookups[-1]  # type: ignore[method-assign]
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, (0, 1, 2, 3, 5))
    assert serve_switching(engine, params, seed=4) == expected
    # Both proposed: some rows' drafts were looked up, others drafted by the head.
    assert any(p.tokens for found in lookups for p in found) and chains
    drafted_rounds = sum(1 for found in lookups if any(p.tokens for p in found))
    assert drafted_rounds > 0 and len(chains) < len(lookups)


def serve_after_rounds_at_k_0(target, head: Eagle3Model, skip: bool) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """Two prompts served six rounds at k = 0, then at k = 3 to the end (output checked against
    target-only): the tokens of each draft-extend the head ran, the positions each sequence held
    when drafting began, and the head's next logits after each round that drafted."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    drafter = Eagle3Drafter(head, target.model, 2, MAX_SEQ_LEN)
    drafter.skip_before_window = skip
    engine = Engine(target, drafter, 2, MAX_SEQ_LEN, (0, 3))
    steps: list[int] = []
    take_held = drafter.take_held

    def counted(seqs: list[Sequence]) -> Extend | None:
        extend = take_held(seqs)
        if extend is not None:
            steps.append(len(extend.tokens))
        return extend

    drafter.take_held = counted  # type: ignore[method-assign]
    requests = [Request(tuple(p), params) for p in PROMPTS[:2]]
    outputs: dict[str, list[int]] = {r.id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    for _ in range(6):
        for out in engine.step(0).outputs:
            outputs[out.request_id].extend(out.new_tokens)
    assert not steps
    held = [len(seq.tokens) - 1 for seq in engine.running]  # every position the target went through
    logits = []
    while engine.has_work:
        for out in engine.step(3).outputs:
            outputs[out.request_id].extend(out.new_tokens)
        logits.append(drafter.next_logits.clone())
    assert [outputs[r.id] for r in requests] == [c.tokens for c in generate(target, PROMPTS[:2], params)]
    return steps, held, logits


@pytest.mark.parametrize("window", [None, 4])
def test_rounds_at_k_0_cost_the_head_nothing_and_drafting_again_catches_up(pair, window):
    """The draft-extend waits until a sequence next drafts: rounds at k = 0 run no head step, and
    the first round at k > 0 after them makes every held position an entry at once (a windowed
    head only those its window will reach)."""
    target, _ = pair
    steps, held, _ = serve_after_rounds_at_k_0(target, head_for(target.model, window=window), skip=True)
    assert steps[0] == sum(min(n, window or n) for n in held)  # the prompts and six rounds, in one step


def test_a_windowed_head_drafts_what_it_would_from_every_entry(pair, trained_head):
    """Entries the window will never reach are not made, and nothing the head drafts changes (a
    window of 8 skips part of the first prompt's held positions and none of the second's)."""
    target, _ = pair
    head = windowed(trained_head, 8)
    skipping, every_entry = (serve_after_rounds_at_k_0(target, head, skip) for skip in (True, False))
    assert skipping[0][0] < every_entry[0][0]  # fewer entries made
    assert all(torch.equal(a, b) for a, b in zip(skipping[2], every_entry[2], strict=True))


def test_a_reduced_draft_vocabulary_drafts_only_its_ids_and_stays_lossless(pair):
    target, _ = pair
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS[:2], params)]
    engine = engine_for(target, 2, (3,), draft_vocab=20)
    drafter: Eagle3Drafter = engine.drafter  # type: ignore[assignment]
    drafted: list[int] = []
    propose = drafter.propose
    drafter.propose = lambda *a: [drafted.extend(p.tokens) or p for p in propose(*a)]  # type: ignore[method-assign]
    requests = [Request(tuple(p), params) for p in PROMPTS[:2]]
    outputs = engine.run_until_done(requests, 3)
    assert [outputs[r.id] for r in requests] == expected
    allowed = set(drafter.model.draft_to_target().tolist())
    assert drafted and set(drafted) <= allowed and len(allowed) == 20


def test_the_cache_follows_the_target_and_rolls_back_exactly(pair, trained_head):
    """After rounds of drafting, keeping and rejecting, the head's entries equal those built fresh
    from the target's own forward over the same tokens: nothing of a rejected chain is left."""
    target, _ = pair
    drafter = Eagle3Drafter(trained_head, target.model, 1, MAX_SEQ_LEN)
    engine = Engine(target, drafter, 1, MAX_SEQ_LEN, (3,))
    engine.add_request(Request(tuple(PROMPTS[2]), SamplingParams(max_tokens=20, ignore_eos=True)))
    for _ in range(4):
        engine.step(3)
    (seq,) = engine.running
    assert engine.states[3].stats.drafts_proposed > engine.states[3].stats.drafts_accepted > 0
    assert drafter.waiting[seq.draft_slot]  # the last verify's kept positions wait for the next draft
    drafter.catch_up([seq])
    length = drafter.cache.lengths[seq.draft_slot]
    assert length == len(seq.tokens) - 1  # one entry per position the target verified

    cache = target.model.new_cache(1, MAX_SEQ_LEN)
    slot = cache.allocate()
    hidden = target.model(target.model.batch(cache, [slot], [seq.tokens[:-1]]), cache, capture=drafter.capture_layers)
    fresh = Eagle3Drafter(drafter.model, target.model, 1, MAX_SEQ_LEN)
    twin = Sequence(seq.request, slot=0, generator=None, tokens=list(seq.tokens))
    fresh.admit([twin], hidden.hidden)
    fresh.catch_up([twin])
    for built, rebuilt in ((drafter.cache.k, fresh.cache.k), (drafter.cache.v, fresh.cache.v)):
        assert torch.allclose(built[0, seq.draft_slot, :length], rebuilt[0, twin.draft_slot, :length], atol=1e-4)
    assert torch.allclose(drafter.next_logits[seq.draft_slot], fresh.next_logits[twin.draft_slot], atol=1e-4)


@pytest.mark.parametrize("norm_before_residual, window", [(False, None), (True, None), (False, 3)])
def test_the_compiled_head_computes_what_the_pytorch_one_does(pair, tmp_path, norm_before_residual, window):
    """On a CPU the head runs on the compiled kernels beside a compiled target: the draft-extend
    of rows of different lengths in one call, then chain steps, give the logits and entries of
    the PyTorch operators (a reduced draft vocabulary included; the residual from the feature or
    from its norm; attention within a sliding window shorter than the prompts)."""
    from tests.conftest import tiny_pair

    target, _ = pair
    if target.model.native is None:
        pytest.skip("no compiled kernels here")
    plain, _ = tiny_pair(tmp_path, native_forward=False)  # the same weights (seeded), on PyTorch operators
    head = head_for(
        target.model, draft_vocab=24, taps=(0, 1, 1), norm_before_residual=norm_before_residual, window=window
    )
    with torch.no_grad():  # weights bfloat16 can hold, as the compiled head streams them
        for param in head.parameters():
            param.copy_(param.to(torch.bfloat16))
    prompts = [PROMPTS[2] + PROMPTS[0], PROMPTS[1]]
    assert window is None or max(map(len, prompts)) > window  # the long prompt's start is never seen
    results = []
    heads = [(target, head, True), (plain, head, True)]
    if window:  # the head unwindowed, and windowed but making every entry, on the kernels
        heads += [(plain, windowed(head, None), True), (target, head, False)]
    for served, head, skip in heads:
        drafter = Eagle3Drafter(head, served.model, 2, MAX_SEQ_LEN)
        drafter.skip_before_window = skip
        cache = served.model.new_cache(2, MAX_SEQ_LEN)
        slots = [cache.allocate() for _ in prompts]
        batch = served.model.batch(cache, slots, [p[:-1] for p in prompts])
        taps = served.model(batch, cache, capture=drafter.capture_layers).hidden
        seqs = [Sequence(Request(tuple(p)), slot=i, generator=None, tokens=list(p)) for i, p in enumerate(prompts)]
        drafter.admit(seqs, taps)
        drafter.catch_up(seqs)
        chain = [drafter.next_logits[[s.draft_slot for s in seqs]].clone()]
        for step, tokens in enumerate(([5, 6], [7, 8])):
            chain.append(drafter.draft([s.draft_slot for s in seqs], tokens, step).clone())
        values = [drafter.cache.v[0, s.draft_slot, : len(p) + 1] for s, p in zip(seqs, prompts)]
        results.append((drafter, chain, values))
    (compiled, chain, values), (reference, expected, expected_values) = results[:2]
    assert compiled.native is not None and reference.native is None
    if window:  # the window changes what the head computes, and no entry it skipped was ever read
        unwindowed, every_entry = results[2][1], results[3][1]
        assert not any(torch.allclose(a, b, atol=1e-3) for a, b in zip(unwindowed, expected))
        assert all(torch.equal(a, b) for a, b in zip(every_entry, chain))
        assert results[3][0].cache.lengths == compiled.cache.lengths
    # The weights are bfloat16 values, so streaming them in bfloat16 loses nothing: equal up to
    # the order of float32 sums.
    for got, want in zip(chain, expected):
        finite = want.isfinite()
        assert torch.equal(finite, got.isfinite()) and int(finite.sum()) == 2 * 24
        assert torch.allclose(got[finite], want[finite], atol=1e-4, rtol=1e-4)
    for got, want in zip(values, expected_values):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def caught_up_head(target, head: Eagle3Model, prompts: list[list[int]]) -> tuple[Eagle3Drafter, list[Sequence]]:
    """A drafter over `head` that has taken in the prompts (the target's prefill taps) and made
    their entries: ready to draft each one's chain."""
    drafter = Eagle3Drafter(head, target.model, len(prompts), MAX_SEQ_LEN)
    cache = target.model.new_cache(len(prompts), MAX_SEQ_LEN)
    slots = [cache.allocate() for _ in prompts]
    batch = target.model.batch(cache, slots, [p[:-1] for p in prompts])
    seqs = [Sequence(Request(tuple(p)), slot=i, generator=None, tokens=list(p)) for i, p in enumerate(prompts)]
    drafter.admit(seqs, target.model(batch, cache, capture=drafter.capture_layers).hidden)
    drafter.catch_up(seqs)
    return drafter, seqs


def test_the_compiled_greedy_chain_drafts_what_the_chain_step_by_step_does(pair, trained_head):
    """Greedy chains run whole in the kernels, one call a round: rows with different k (one drops
    out early, one has no steps after its first draft) draft exactly the tokens of the chain run a
    step at a time from Python, and both leave the same entries in the head's cache."""
    target, _ = pair
    if target.model.native is None:
        pytest.skip("no compiled kernels here")
    prompts = [PROMPTS[2] + PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    drafter, seqs = caught_up_head(target, trained_head, prompts)
    ks, rows = [7, 3, 1], [0, 1, 2]
    compiled = [Proposal([]) for _ in seqs]
    drafter.native_chains(seqs, ks, rows, compiled, EVERY_DRAFT)
    entries = [drafter.cache.k[0, s.draft_slot].clone() for s in seqs]
    stepped = [Proposal([]) for _ in seqs]
    drafter.chains(seqs, ks, rows, stepped, EVERY_DRAFT)
    assert [len(p.tokens) for p in compiled] == ks
    assert [p.tokens for p in compiled] == [p.tokens for p in stepped]
    assert len({tuple(p.tokens) for p in compiled}) == len(seqs)  # the rows drafted their own chains
    for seq, before in zip(seqs, entries):
        assert torch.allclose(drafter.cache.k[0, seq.draft_slot], before, atol=1e-5)


def test_a_greedy_chain_stops_at_the_first_draft_the_head_is_unsure_of(pair, trained_head):
    """With a floor, each greedy chain keeps its drafts up to the first one whose probability
    under the head is below it, and drafts nothing after: in the kernels as step by step, the
    same drafts as the whole chain's first ones, and the rest counted as trimmed."""
    target, _ = pair
    prompts = [PROMPTS[2] + PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[0]]
    drafter, seqs = caught_up_head(target, trained_head, prompts)
    rows, ks = list(range(len(seqs))), [7] * len(seqs)
    saved = drafter.next_logits.clone(), drafter.next_feature.clone()

    def chains(compiled: bool, floor: float) -> list[Proposal]:
        drafter.next_logits[:], drafter.next_feature[:] = saved  # a step-by-step chain moves them on
        proposals = [Proposal([]) for _ in seqs]
        if compiled:
            drafter.native_chains(seqs, ks, rows, proposals, ConfidenceRule(floor))
        else:
            drafter.chains(seqs, ks, rows, proposals, ConfidenceRule(floor))
        return proposals

    # Each draft's probability under the head, as the whole chain goes (floor 0).
    sure: dict[int, list[float]] = {s.draft_slot: [] for s in seqs}
    step = drafter.draft

    def recording(slots, tokens, at):
        logits = step(slots, tokens, at)
        for slot, top in zip(slots, logits.float().softmax(dim=-1).amax(dim=-1).tolist()):
            sure[slot].append(top)
        return logits

    first = saved[0][[s.draft_slot for s in seqs]].float().softmax(dim=-1).amax(dim=-1).tolist()
    for seq, top in zip(seqs, first):
        sure[seq.draft_slot].append(top)
    drafter.draft = recording
    whole = chains(compiled=False, floor=0.0)
    drafter.draft = step
    assert all(len(p.tokens) == 7 for p in whole)
    chances = [sure[s.draft_slot][:7] for s in seqs]
    floor = sorted(c for row in chances for c in row)[len(seqs) * 7 // 3]  # a third of the drafts below it
    kept = [next((j for j, c in enumerate(row) if c < floor), 7) for row in chances]
    assert 0 < sum(kept) < 7 * len(seqs) and len(set(kept)) > 1, "some chains stop early, at different drafts"
    ways = [chains(compiled=False, floor=floor)]
    if target.model.native is not None:
        ways.append(chains(compiled=True, floor=floor))
    for proposals in ways:
        assert [len(p.tokens) for p in proposals] == kept
        assert [p.tokens for p in proposals] == [w.tokens[:n] for w, n in zip(whole, kept)]
        assert [p.trimmed for p in proposals] == [7 - n for n in kept]


def test_the_compiled_sampled_chain_draws_what_the_chain_step_by_step_does(pair, trained_head):
    """Sampled chains run whole in the kernels too: from the same generators, rows of different
    k, temperature and top-p draw the tokens the chain a step at a time draws, with the same
    probabilities for the rejection rule."""
    target, _ = pair
    if target.model.native is None:
        pytest.skip("no compiled kernels here")
    prompts = [PROMPTS[2] + PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    params = [SamplingParams(temperature=t, top_p=p) for t, p in ((1.0, 1.0), (0.7, 0.9), (1.3, 0.5))]
    ks, drafted = [7, 4, 1], []
    for in_kernels in (True, False):
        drafter = Eagle3Drafter(trained_head, target.model, len(prompts), MAX_SEQ_LEN)
        cache = target.model.new_cache(len(prompts), MAX_SEQ_LEN)
        slots = [cache.allocate() for _ in prompts]
        batch = target.model.batch(cache, slots, [p[:-1] for p in prompts])
        seqs = [
            Sequence(Request(tuple(p), q), slot=i, generator=torch.Generator().manual_seed(i), tokens=list(p))
            for i, (p, q) in enumerate(zip(prompts, params))
        ]
        drafter.admit(seqs, target.model(batch, cache, capture=drafter.capture_layers).hidden)
        drafter.catch_up(seqs)
        drafter.sampled_in_kernels = in_kernels
        drafted.append(drafter.propose(seqs, ks))
    compiled, stepped = drafted
    assert [len(p.tokens) for p in compiled] == ks
    assert [p.tokens for p in compiled] == [p.tokens for p in stepped]
    for mine, theirs in zip(compiled, stepped):
        torch.testing.assert_close(mine.probs, theirs.probs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_a_greedy_round_in_one_call_drafts_what_the_extend_and_the_step_chain_do(pair, trained_head, floor):
    """On the compiled kernels a greedy round's draft-extend and chains are one call: rows with
    different k draft exactly the tokens of the extend and the chains called apart (and of the
    chain run a step at a time from Python), stopping where they stop under a floor, and leave
    the same next logits, features and cache entries."""
    target, _ = pair
    if target.model.native is None:
        pytest.skip("no compiled kernels here")
    prompts = [PROMPTS[2] + PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    ks = [7, 3, 1]
    served = []
    for one_call in (True, False):
        drafter = Eagle3Drafter(trained_head, target.model, len(prompts), MAX_SEQ_LEN)
        assert drafter.rounds_in_one_call
        cache = target.model.new_cache(len(prompts), MAX_SEQ_LEN)
        slots = [cache.allocate() for _ in prompts]
        batch = target.model.batch(cache, slots, [p[:-1] for p in prompts])
        seqs = [Sequence(Request(tuple(p)), slot=i, generator=None, tokens=list(p)) for i, p in enumerate(prompts)]
        drafter.admit(seqs, target.model(batch, cache, capture=drafter.capture_layers).hidden)
        if one_call:
            proposals = drafter.propose(seqs, ks, ConfidenceRule(floor))
        else:
            drafter.catch_up(seqs)
            proposals = [Proposal([]) for _ in seqs]
            drafter.native_chains(seqs, ks, [0, 1, 2], proposals, ConfidenceRule(floor))
        after = {name: getattr(drafter, name).clone() for name in ("next_logits", "next_feature")}
        entries = drafter.cache.k[0].clone()
        if not one_call:
            stepped = [Proposal([]) for _ in seqs]
            drafter.chains(seqs, ks, [0, 1, 2], stepped, ConfidenceRule(floor))  # last: it moves the next logits
            assert [p.tokens for p in stepped] == [p.tokens for p in proposals]
        served.append((drafter, [p.tokens for p in proposals], after, entries))
        assert [len(p.tokens) + p.trimmed for p in proposals] == ks
    (fused, drafts, fused_after, fused_entries), (apart, expected, apart_after, apart_entries) = served
    assert drafts == expected
    assert ([len(d) for d in drafts] == ks) == (floor == 0), "a floor stops some chain early"
    for name, value in fused_after.items():
        assert torch.equal(value, apart_after[name]), name
    assert fused.cache.lengths == apart.cache.lengths
    assert torch.equal(fused_entries, apart_entries)


@pytest.mark.parametrize(
    "verification, draft_vocab, in_kernels",
    [("block", None, True), ("token", None, True), ("block", 4, True), ("block", None, False), ("token", 4, False)],
)
def test_sampling_keeps_the_target_distribution(tiny_vocab_pair, verification, draft_vocab, in_kernels):
    """Whatever the rejection rule, with drafts drawn from a reduced draft vocabulary too, and
    whether the chains are drawn in the compiled kernels or a step at a time."""
    target, _ = tiny_vocab_pair
    prompt = tuple(range(8)) * 2
    base = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True)
    with torch.inference_mode():
        marginals = exact_marginals(target, prompt, base, 3)
    drafter = Eagle3Drafter(head_for(target.model, draft_vocab), target.model, 16, 32)
    assert drafter.sampled_in_kernels == (drafter.native is not None)
    if in_kernels and drafter.native is None:
        pytest.skip("the compiled kernels are not built here")
    drafter.sampled_in_kernels = in_kernels
    engine = Engine(target, drafter, 16, 32, [2], verification=verification)
    requests = [
        Request(prompt, SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True))
        for s in range(1500)
    ]
    outputs = engine.run_until_done(requests, 2)
    assert engine.states[2].stats.drafts_proposed > 0
    assert_follows_marginals(outputs, requests, marginals)
