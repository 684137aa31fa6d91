"""The EAGLE-3 head: lossless at every k and under switching, its chain the one it was trained to
draft, its cache in step with the target, and the published checkpoint layout loaded and checked."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from daemon.metrics import Metrics
from engine import native as kernels
from engine.config import CheckpointError, Eagle3Config, ModelConfig, eagle3_taps
from engine.core import Engine, StepResult
from engine.drafters import Proposal
from engine.eagle3 import Eagle3Drafter, Eagle3Model, Extend, HybridEagle3Drafter, load_eagle3, save_eagle3
from engine.generate import generate
from engine.request import Request, Sequence
from engine.sampling import SamplingParams
from tests.conftest import ROOT
from tests.test_dflash import assert_serves_losslessly, bench_modes_naming, serve_switching
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
    from train_eagle3 import ttt_loss

    target, _ = pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    tokens = torch.tensor([(p + c.tokens)[:42] for p, c in zip(PROMPTS, generate(target, PROMPTS, params))])
    head = head_for(target.model, taps=(0, 1, 1)).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(120):
        loss, _ = ttt_loss(head, target.model, tokens, 16, 4, 0.8, generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval().requires_grad_(False)


def windowed(head: Eagle3Model, window: int | None) -> Eagle3Model:
    """The same head attending to at most `window` positions."""
    twin = Eagle3Model(replace(head.config, sliding_window=window), head.taps)
    twin.load_state_dict(head.state_dict())
    return twin.eval().requires_grad_(False)


def engine_for(target, batch: int, ks=(0, 1, 2, 3, 5), initial: int | None = None, **head) -> Engine:
    drafter = Eagle3Drafter(head_for(target.model, **head), target.model, batch, MAX_SEQ_LEN)
    return Engine(target, drafter, batch, MAX_SEQ_LEN, ks, initial_k=initial)


def test_sglang_default_taps_are_the_outputs_before_layers_2_l_half_and_l_minus_3():
    target = ModelConfig("llama", 64, 64, 96, num_layers=32, num_heads=4, num_kv_heads=2, head_dim=16)
    config = Eagle3Config(64, 4, 2, 16, 96, 64, 64, 64, target_layer_ids=None)
    assert eagle3_taps(config, target) == (1, 15, 28)
    assert eagle3_taps(replace(config, target_layer_ids=(2, 3, 4)), target) == (2, 3, 4)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_target_only_for_every_k(pair, batch):
    target, _ = pair
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = PROMPTS[:batch]
    expected = [c.tokens for c in generate(target, prompts, params)]
    for k in (0, 1, 2, 3, 5, 8):
        engine = engine_for(target, batch, (k,), k)
        requests = [Request(tuple(p), params) for p in prompts]
        outputs = engine.run_until_done(requests)
        assert [outputs[r.id] for r in requests] == expected, f"k={k}"
        if k:
            assert engine.state.stats.drafts_proposed > 0


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
    """While the policy adapts (engine.draft_confidence), the head's greedy chains stop at a
    draft it is unsure of: rounds verify fewer drafts than k, the metric counts the drafts left
    out, and the output is target-only's with k changed at random every round."""
    target, _ = pair
    if native and target.model.native is None:
        pytest.skip("no compiled kernels here")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    if not native:
        monkeypatch.setattr(kernels, "available", lambda *args: False)
    drafter = kind(trained_head, target.model, 4, MAX_SEQ_LEN)
    assert (drafter.native is not None) == native
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, (0, 1, 2, 3, 5))
    engine.draft_confidence = 0.1
    metrics, step = Metrics(max_k=5), engine.step

    def observed() -> StepResult:
        result = step()
        metrics.observe_step(result)
        return result

    engine.step = observed  # type: ignore[method-assign]
    assert serve_switching(engine, params, seed=3) == expected
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
    engine = Engine(target, drafter, 2, MAX_SEQ_LEN, (0, 3), initial_k=0)
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
        for out in engine.step().outputs:
            outputs[out.request_id].extend(out.new_tokens)
    assert not steps
    held = [len(seq.tokens) - 1 for seq in engine.running]  # every position the target went through
    engine.select(3)
    logits = []
    while engine.has_work:
        for out in engine.step().outputs:
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
    engine = engine_for(target, 2, (3,), 3, draft_vocab=20)
    drafter: Eagle3Drafter = engine.drafter  # type: ignore[assignment]
    drafted: list[int] = []
    propose = drafter.propose
    drafter.propose = lambda *a: [drafted.extend(p.tokens) or p for p in propose(*a)]  # type: ignore[method-assign]
    requests = [Request(tuple(p), params) for p in PROMPTS[:2]]
    outputs = engine.run_until_done(requests)
    assert [outputs[r.id] for r in requests] == expected
    allowed = set(drafter.model.draft_to_target().tolist())
    assert drafted and set(drafted) <= allowed and len(allowed) == 20


def test_the_served_chain_is_the_unroll_it_was_trained_on(tmp_path):
    """tools/train_eagle3.py computes a chain's logits (training-time test) as the drafter does
    when serving (on PyTorch operators, as training runs): the same tokens give the same logits
    at every step of the chain."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_eagle3 import chain_attention

    from tests.conftest import tiny_pair

    target, _ = tiny_pair(tmp_path, native_forward=False)
    head = head_for(target.model, taps=(0, 1, 1))
    tokens = torch.tensor([PROMPTS[0] + PROMPTS[2] + PROMPTS[1]])
    start, unroll = 9, 4
    with torch.no_grad():
        _, taps = target.model.train_layers(tokens, head.taps)
        embeds = target.model.embed_tokens(tokens).float()
        features = head.features(torch.cat([taps[i] for i in head.taps], dim=-1).float())
        entries = tokens.shape[1] - 1
        _, keys, values = head.qkv(embeds[:, 1:], features[:, :entries], torch.arange(entries))
        starts, rows = torch.tensor([[start]]), torch.arange(1)[:, None]
        feature, own, trained = features[rows, starts], [], []
        for j in range(unroll):
            q, k, v = head.qkv(embeds[rows, starts + j + 1], feature, starts + j)
            if j > 0:
                own.append((k, v))
            feature = head.finish(chain_attention(q, keys, values, starts, own), feature)
            trained.append(head.logits(feature)[0, 0])

    drafter = Eagle3Drafter(head, target.model, 1, MAX_SEQ_LEN)
    prefix = tokens[0, : start + 2].tolist()  # positions 0..start went through the target
    cache = target.model.new_cache(1, MAX_SEQ_LEN)
    slot = cache.allocate()
    hidden = target.model(target.model.batch(cache, [slot], [prefix[:-1]]), cache, capture=drafter.capture_layers)
    seq = Sequence(Request(tuple(prefix), SamplingParams()), slot=0, generator=None, tokens=list(prefix))
    drafter.admit([seq], hidden.hidden)
    drafter.catch_up([seq])
    served = [drafter.next_logits[seq.draft_slot].clone()]
    for j in range(1, unroll):
        served.append(drafter.draft([seq.draft_slot], [int(tokens[0, start + 1 + j])], j - 1)[0])
    for j in range(unroll):
        assert torch.allclose(served[j], trained[j], atol=1e-4), f"step {j}"


def test_the_cache_follows_the_target_and_rolls_back_exactly(pair, trained_head):
    """After rounds of drafting, keeping and rejecting, the head's entries equal those built fresh
    from the target's own forward over the same tokens: nothing of a rejected chain is left."""
    target, _ = pair
    drafter = Eagle3Drafter(trained_head, target.model, 1, MAX_SEQ_LEN)
    engine = Engine(target, drafter, 1, MAX_SEQ_LEN, (3,), initial_k=3)
    engine.add_request(Request(tuple(PROMPTS[2]), SamplingParams(max_tokens=20, ignore_eos=True)))
    for _ in range(4):
        engine.step()
    (seq,) = engine.running
    assert engine.state.stats.drafts_proposed > engine.state.stats.drafts_accepted > 0
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
    drafter.native_chains(seqs, ks, rows, compiled)
    entries = [drafter.cache.k[0, s.draft_slot].clone() for s in seqs]
    stepped = [Proposal([]) for _ in seqs]
    drafter.chains(seqs, ks, rows, stepped)
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
            drafter.native_chains(seqs, ks, rows, proposals, floor)
        else:
            drafter.chains(seqs, ks, rows, proposals, floor)
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
            proposals = drafter.propose(seqs, ks, floor)
        else:
            drafter.catch_up(seqs)
            proposals = [Proposal([]) for _ in seqs]
            drafter.native_chains(seqs, ks, [0, 1, 2], proposals, floor)
        after = {name: getattr(drafter, name).clone() for name in ("next_logits", "next_feature")}
        entries = drafter.cache.k[0].clone()
        if not one_call:
            stepped = [Proposal([]) for _ in seqs]
            drafter.chains(seqs, ks, [0, 1, 2], stepped, floor)  # last: it moves the next logits
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
    outputs = engine.run_until_done(requests)
    assert engine.state.stats.drafts_proposed > 0
    assert_follows_marginals(outputs, requests, marginals)


def published_head(model: Eagle3Model, path, **config) -> None:
    """`model` written as SpecForge writes a head: bfloat16 weights, its config keys, the taps
    under eagle_config, the target's embedding carried along, d2t and t2d beside the weights."""
    save_eagle3(model, path, torch.bfloat16)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("target", None)
    raw.update({"transformers_version": "4.51.0", "use_cache": True}, **config)
    (path / "config.json").write_text(json.dumps(raw))
    state = load_file(str(path / "model.safetensors"))
    state["embed_tokens.weight"] = torch.zeros(model.config.vocab_size, model.config.hidden_size, dtype=torch.bfloat16)
    save_file(state, str(path / "model.safetensors"))


def test_a_head_in_the_published_layout_loads_and_drafts_what_it_did(pair, tmp_path):
    target, _ = pair
    model = head_for(target.model, draft_vocab=24, taps=(0, 1, 1))
    published_head(model, tmp_path / "head")
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 24
    assert raw["torch_dtype"] == "bfloat16"
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    names = set(load_file(str(tmp_path / "head" / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "d2t", "t2d"} <= names

    loaded = load_eagle3(tmp_path / "head", target.model)
    assert loaded.taps == (0, 1, 1) and torch.equal(loaded.d2t, model.d2t) and loaded.d2t.dtype == torch.long
    feature = torch.randn(3, target.model.config.hidden_size)
    with torch.no_grad():
        expected = model.logits(feature).argmax(-1)
        assert torch.equal(loaded.logits(feature).argmax(-1), expected)  # bfloat16 weights, the same choices
        assert bool(loaded.t2d[expected].all())

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = Engine(target, Eagle3Drafter(loaded, target.model, 2, MAX_SEQ_LEN), 2, MAX_SEQ_LEN, [3], initial_k=3)
    requests = [Request(tuple(p), params) for p in PROMPTS[:2]]
    outputs = engine.run_until_done(requests)
    assert [outputs[r.id] for r in requests] == [c.tokens for c in generate(target, PROMPTS[:2], params)]


def speculators_head(model: Eagle3Model, path, **config) -> None:
    """`model` written in vLLM's speculators layout: the layer's Llama config nested, tap ids
    counted as layer inputs, the decoder layer's weights under layers.0, the embedding carried."""
    c = model.config
    save_eagle3(model, path, torch.bfloat16)
    raw = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.2.0",
        "transformer_layer_config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size,
            "vocab_size": c.vocab_size,
            "num_hidden_layers": 1,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope.theta,
            "max_position_embeddings": 4096,
        },
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": [t + 1 for t in model.taps],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]},
        },
        **config,
    }
    (path / "config.json").write_text(json.dumps(raw))
    state = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    state["embed_tokens.weight"] = torch.zeros(c.vocab_size, c.hidden_size, dtype=torch.bfloat16)
    save_file(state, str(path / "model.safetensors"))


def test_a_head_in_the_speculators_layout_loads_drafts_what_it_did_and_serves_losslessly(pair, tmp_path):
    """vLLM's layout: the residual from the normed feature, tap ids one past the layers read."""
    target, _ = pair
    model = head_for(target.model, draft_vocab=24, taps=(0, 1, 1), norm_before_residual=True)
    speculators_head(model, tmp_path / "head")
    assert "layers.0.self_attn.q_proj.weight" in load_file(str(tmp_path / "head" / "model.safetensors"))
    loaded = load_eagle3(tmp_path / "head", target.model)
    assert loaded.taps == (0, 1, 1) and loaded.config.norm_before_residual and loaded.config.target == "tiny-target"
    assert torch.equal(loaded.d2t, model.d2t)
    feature, attended = torch.randn(3, target.model.config.hidden_size), torch.randn(3, 4, 16)
    with torch.no_grad():
        expected = model.logits(model.finish(attended, feature))
        assert torch.equal(loaded.logits(loaded.finish(attended, feature)).argmax(-1), expected.argmax(-1))
        # The flag is honoured: the same weights with the residual from the raw feature differ.
        model.config = replace(model.config, norm_before_residual=False)
        assert not torch.allclose(model.logits(model.finish(attended, feature)), expected)

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = Engine(target, Eagle3Drafter(loaded, target.model, 2, MAX_SEQ_LEN), 2, MAX_SEQ_LEN, [3], initial_k=3)
    requests = [Request(tuple(p), params) for p in PROMPTS[:2]]
    outputs = engine.run_until_done(requests)
    assert [outputs[r.id] for r in requests] == [c.tokens for c in generate(target, PROMPTS[:2], params)]

    # Saved again, it keeps its residual convention in the SpecForge layout.
    save_eagle3(loaded, tmp_path / "again")
    assert load_eagle3(tmp_path / "again", target.model).config.norm_before_residual


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"speculators_model_type": "medusa"}, "type 'medusa'; only eagle3 heads load"),
        ({"transformer_layer_config": None}, "needs a transformer_layer_config"),
        ({"norm_before_fc": True}, "norm_before_fc"),
        ({"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, "0 is the embedding"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}, "taps [8] outside the target's layers"),
        ({"draft_vocab_size": 500}, "draft vocabulary of 500"),
    ],
)
def test_a_speculators_head_that_does_not_fit_is_refused_by_name(pair, tmp_path, edit, named):
    target, _ = pair
    speculators_head(head_for(target.model, draft_vocab=24, taps=(0, 1, 1)), tmp_path / "head", **edit)
    with pytest.raises(CheckpointError, match=re.escape(named)):
        load_eagle3(tmp_path / "head", target.model)


def test_checkpoint_round_trip_and_every_mismatch_named(pair, tmp_path):
    target, _ = pair
    model = head_for(target.model)
    save_eagle3(model, tmp_path / "head")
    loaded = load_eagle3(tmp_path / "head", target.model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name])
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert "sliding_window" not in raw  # attends to every position before it
    save_eagle3(windowed(model, 256), tmp_path / "windowed")
    assert load_eagle3(tmp_path / "windowed", target.model).config.sliding_window == 256
    unused = json.loads((tmp_path / "windowed" / "config.json").read_text()) | {"use_sliding_window": False}
    (tmp_path / "windowed" / "config.json").write_text(json.dumps(unused))  # as Qwen configs carry one
    assert load_eagle3(tmp_path / "windowed", target.model).config.sliding_window is None

    def broken(name: str, edit, weights=None) -> str:
        bad = tmp_path / name
        save_eagle3(model, bad)
        edited = json.loads(json.dumps(raw))
        edit(edited)
        (bad / "config.json").write_text(json.dumps(edited))
        if weights:
            state = load_file(str(bad / "model.safetensors"))
            weights(state)
            save_file(state, str(bad / "model.safetensors"))
        with pytest.raises(CheckpointError) as caught:
            load_eagle3(bad, target.model)
        return str(caught.value)

    assert "hidden size 32" in broken("hidden", lambda c: c.update(target_hidden_size=32))
    assert "vocabulary of 10" in broken("vocab", lambda c: c.update(vocab_size=10))
    taps = {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}
    assert "taps [7] outside" in broken("taps", lambda c: c.update(eagle_config=taps))
    assert "three" in broken("two", lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1]}))
    assert "one decoder layer" in broken("layers", lambda c: c.update(num_hidden_layers=2))
    assert "not an EAGLE-3 head (architectures ['DFlashDraftModel'])" in broken(
        "dflash", lambda c: c.update(architectures=["DFlashDraftModel"])
    )
    assert "not an EAGLE-3 config" in broken("plain", lambda c: c.pop("hidden_size"))
    for window in (-4, 2.5, "256", True):
        assert f"sliding_window must be a whole number of positions >= 1 or null, got {window!r}" in broken(
            "window", lambda c, window=window: c.update(sliding_window=window)
        )
    assert "missing ['fc.weight']" in broken("fc", lambda c: None, lambda s: s.pop("fc.weight"))
    assert "q_proj.weight has shape" in broken(
        "shape", lambda c: None, lambda s: s.update({"midlayer.self_attn.q_proj.weight": torch.zeros(3, 3)})
    )
    reduced = tmp_path / "reduced"
    published_head(head_for(target.model, draft_vocab=8), reduced)
    state = load_file(str(reduced / "model.safetensors"))
    state["d2t"] = state["d2t"] + 1000
    save_file(state, str(reduced / "model.safetensors"))
    with pytest.raises(CheckpointError, match="d2t maps draft ids outside the vocabulary"):
        load_eagle3(reduced, target.model)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_eagle3(tmp_path / "nowhere", target.model)


@pytest.mark.parametrize("kind", ["eagle3", "hybrid_eagle3"])
def test_the_config_the_daemon_and_the_benches_take_the_eagle3_drafter(pair, tmp_path, kind):
    from control.issues import ConfigError
    from control.load import load_config
    from daemon.runtime import build_controller, load_models

    target, _ = pair
    save_eagle3(head_for(target.model), tmp_path / "head")
    config = tmp_path / "config.toml"
    config.write_text(
        f'[engine]\ntarget = "{target.path}"\ndrafter = "{kind}"\neagle3 = "head"\nmax_seq_len = {MAX_SEQ_LEN}\n'
        "[adaptive]\ncandidate_k = [0, 2, 5]\n"
    )
    snapshot = load_config(config, check_models=True)
    controller = build_controller(snapshot, load_models(snapshot), max_batch_size=2)
    drafter = controller.engine.drafter
    assert isinstance(drafter, Eagle3Drafter) and isinstance(drafter, HybridEagle3Drafter) == (kind == "hybrid_eagle3")
    assert_serves_losslessly(controller, target)
    assert sum(state.stats.drafts_proposed for state in controller.engine.states.values()) > 0

    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps({**raw, "vocab_size": 10}))
    with pytest.raises(ConfigError, match="engine.eagle3: .*does not fit the target: vocabulary of 10"):
        load_config(config, check_models=True)
    # A config its weights do not match: found from their file's header, before anything loads.
    heads = raw["num_attention_heads"] - 1
    (tmp_path / "head" / "config.json").write_text(json.dumps({**raw, "num_attention_heads": heads}))
    with pytest.raises(
        ConfigError, match=r"engine.eagle3: .*model\.safetensors: midlayer\.self_attn\.\w+_proj\.weight has shape"
    ):
        load_config(config, check_models=True)
    (tmp_path / "head" / "config.json").write_text(json.dumps(raw))
    (tmp_path / "head" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"engine.eagle3: .*model\.safetensors: not a readable safetensors file"):
        load_config(config, check_models=True)


@pytest.mark.parametrize(
    "option, named",
    [
        (["--greedy-weight", "1.5"], "--greedy-weight must be between 0 and 1, not 1.5"),
        (["--time-budget", "-5"], "--time-budget must be 0 (train --steps) or a number of seconds, not -5.0"),
        (["--intermediate-size", "-1"], "argument --intermediate-size: must be at least 0, not -1"),
        (["--chains", "0"], "argument --chains: must be at least 1, not 0"),
        (["--lr", "-1"], "argument --lr: must be above 0, not -1"),
        (["--regenerate", "-3"], "argument --regenerate: must be at least 0, not -3"),
        (["--seq-len", "5"], "--seq-len must be above --unroll + 1 (8), not 5"),
        (["--sampled-share", "2"], "--sampled-share must be between 0 and 1, not 2.0"),
        (["--sample-temperature", "0"], "argument --sample-temperature: must be above 0, not 0"),
    ],
)
def test_the_training_script_names_an_option_out_of_range(tmp_path, option, named):
    out = tmp_path / "head"
    command = [sys.executable, "tools/train_eagle3.py", "models/target", str(out), *option]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and named in done.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "script, option, named",
    [
        ("train_eagle3.py", ["--taps", "99", "0", "1"], "taps [99] outside the target's layers 0..7"),
        ("train_eagle3.py", ["--lr", "1e30", "--steps", "5"], "try a lower --lr"),
        ("train_eagle3.py", ["--data", "/nowhere"], "/nowhere: no such file or folder"),
        ("train_dflash.py", ["--mask-token", "999999"], "mask token id 999999 outside the vocabulary"),
        ("train_dflash.py", ["--taps", "99"], "--taps 99: the target has 8 layers to tap"),
        ("train_dflash.py", ["--lr", "1e30", "--steps", "5"], "try a lower --lr"),
    ],
)
def test_a_training_run_that_cannot_give_a_drafter_stops_with_a_line_saying_why(tmp_path, script, option, named):
    # A loss that is no longer a number stops the run before a drafter of NaN weights is saved.
    (tmp_path / "data.txt").write_text(" ".join(f"w{i % 37}" for i in range(400)))
    out = tmp_path / "drafter"
    command = [sys.executable, f"tools/{script}", "models/target", str(out), "--seq-len", "40", "--batch", "2"]
    command += ["--prompts", "0", "--data", str(tmp_path / "data.txt"), *option]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and named in done.stderr and "Traceback" not in done.stderr
    assert not (out / "model.safetensors").exists()


def test_the_training_script_runs_end_to_end_and_its_loss_falls(pair, tmp_path):
    """On the target's own greedy continuations of a small corpus: the loss (KL from the target's
    distribution, every unrolled step) falls, the head loads, and a second run resumes."""
    import random

    target, _ = pair
    rng = random.Random(3)
    (tmp_path / "data.txt").write_text(" ".join(f"w{rng.randrange(2, 40)}" for _ in range(400)))
    out, work = tmp_path / "head", tmp_path / "work"
    command = [sys.executable, "tools/train_eagle3.py", str(target.path), str(out), "--steps", "60", "--unroll", "3"]
    command += ["--seq-len", "40", "--prompt-len", "16", "--regenerate", "12", "--chains", "8", "--batch", "4"]
    command += ["--lr", "3e-3", "--data", str(tmp_path / "data.txt"), "--prompts", "0", "--work", str(work)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "training_report.json").read_text())
    assert report["last_loss"] < 0.6 * report["first_loss"]
    assert len(report["last_loss_per_step"]) == 3
    head = load_eagle3(out, target.model)
    assert head.taps == tuple(report["taps"])
    assert head.config.sliding_window == 40  # no further back at inference than its training sequences
    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "resuming at step 60" in resumed.stderr
    # The same --work, other options: its checkpoint and its sequences are named, not loaded.
    other = subprocess.run(command + ["--draft-vocab", "16"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert other.returncode == 1 and f"{work / 'state.pt'}: left by a run with other options" in other.stderr
    longer = [*command, "--seq-len", "48"]
    other = subprocess.run(longer, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (
        other.returncode == 1
        and f"{work / 'greedy.pt'}: holds sequences of 40 tokens, not --seq-len 48" in other.stderr
    )

    # A head over the 16 most frequent tokens, started from the first one's rows for them.
    reduced = tmp_path / "reduced"
    command[3], command[5] = str(reduced), "10"
    command[command.index("--work") + 1] = str(tmp_path / "work16")
    command += ["--init", str(out), "--draft-vocab", "16"]
    # Held-out files of its own: the head serves prompts cut from them at the end.
    lines = [" ".join(f"w{rng.randrange(2, 40)}" for _ in range(6)) for _ in range(12)]
    (tmp_path / "held.py").write_text("\n".join(lines[:8] + ["def w3(w4):"] + lines[8:]) + "\n")
    command[command.index("--prompts") + 1] = "2"
    # ...and trained on the cross-entropy of the target's argmax as much as on the KL.
    command += ["--held-out", str(tmp_path / "held.py"), "--greedy-weight", "0.5"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    reduced_report = json.loads((reduced / "training_report.json").read_text())
    assert reduced_report["greedy_weight"] == 0.5 and reduced_report["last_loss"] < reduced_report["first_loss"]
    held_out = reduced_report["held_out"]
    assert held_out["rounds"] > 0 and len(held_out["kept_at_position"]) == 3
    small = load_eagle3(reduced, target.model)
    ids = small.draft_to_target()
    counts = torch.bincount(torch.load(work / "greedy.pt").flatten(), minlength=64)
    outside = counts.clone()
    outside[ids] = -1
    assert small.config.draft_vocab_size == 16 and int(counts[ids].min()) >= int(outside.max())  # the most frequent
    assert bool(small.t2d[ids].all()) and int(small.t2d.sum()) == 16

    # Widened from the first head (its MLP twice the target's) and trained for a time budget.
    wide, width = tmp_path / "wide", 2 * target.model.config.intermediate_size
    command = [sys.executable, "tools/train_eagle3.py", str(target.path), str(wide), "--init", str(out)]
    command += ["--time-budget", "2", "--intermediate-size", str(width), "--unroll", "3", "--seq-len", "40"]
    command += ["--prompt-len", "16", "--regenerate", "12", "--chains", "8", "--batch", "4", "--prompts", "0"]
    command += ["--data", str(tmp_path / "data.txt"), "--work", str(tmp_path / "work_wide")]
    command += ["--sampled-share", "0.5"]  # half its continuations sampled at the default temperature
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    wide_report = json.loads((wide / "training_report.json").read_text())
    assert wide_report["time_budget"] == 2 and wide_report["steps"] > 0
    assert wide_report["sampled_share"] == 0.5 and wide_report["sample_temperature"] == 0.8
    assert len(torch.load(tmp_path / "work_wide" / "sampled-0.8.pt")) == 6
    assert 2 <= wide_report["wall_seconds_this_run"] < 60
    assert load_eagle3(wide, target.model).config.intermediate_size == width


def test_a_head_widened_for_training_starts_as_the_narrower_one(pair):
    """--init with a wider --intermediate-size: the new units cannot change the output until they
    learn (their down projections start at zero), so training starts from the narrower head."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_eagle3 import widen_mlp

    target, _ = pair
    narrow = head_for(target.model, draft_vocab=8)
    wide = Eagle3Model(replace(narrow.config, intermediate_size=160), narrow.taps)
    wide.load_state_dict(widen_mlp(narrow.state_dict(), wide))
    features = torch.randn(3, narrow.config.hidden_size)
    attended = torch.randn(3, narrow.config.num_heads, narrow.config.head_dim)
    torch.testing.assert_close(wide.finish(attended, features), narrow.finish(attended, features))
    assert wide.midlayer.mlp.gate_proj.weight[96:].abs().sum() > 0  # the new units can learn
    torch.testing.assert_close(wide.draft_logits(features), narrow.draft_logits(features))
    with pytest.raises(SystemExit, match="an MLP of 96 units: it can be widened to --intermediate-size, not cut to 64"):
        widen_mlp(narrow.state_dict(), Eagle3Model(replace(narrow.config, intermediate_size=64), narrow.taps))


def test_regenerated_continuations_are_the_targets_own_output_and_resume(pair, tmp_path):
    """The training data the scripts regenerate: each window followed by what the target itself
    decodes greedily, many windows decoded in step; a second call adds to the first's. Sampled
    continuations are the seed's own, and near temperature 0 the greedy ones."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_dflash import target_continuations

    target, _ = pair
    data = torch.tensor([t for prompt in PROMPTS for t in prompt] * 3)
    path = tmp_path / "greedy.pt"
    first = target_continuations(target.path, data, 5, 6, 9, path, seed=1, chunk=2)
    assert first.shape == (5, 15)
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    expected = generate(target, [row[:6].tolist() for row in first], params)
    assert [row[6:].tolist() for row in first] == [c.tokens for c in expected]
    more = target_continuations(target.path, data, 7, 6, 9, path, seed=1, chunk=4)
    assert more.shape == (7, 15) and torch.equal(more[:5], first)

    sampled = [target_continuations(target.path, data, 5, 6, 9, tmp_path / f"{i}.pt", 1, temperature=1.0) for i in "ab"]
    assert torch.equal(sampled[0], sampled[1]) and torch.equal(sampled[0][:, :6], first[:, :6])
    assert not torch.equal(sampled[0], first)
    cold = target_continuations(target.path, data, 5, 6, 9, tmp_path / "cold.pt", 1, temperature=1e-4)
    assert torch.equal(cold, first)


def test_training_files_leave_out_the_folders_named(tmp_path):
    """--exclude: a package's vendored copies of other packages stay out of the training data."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_dflash import text_files

    for name in ("pkg/a.py", "pkg/_vendor/b.py", "pkg/sub/tests/c.py", "pkg/sub/d.py", "pkg/notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    names = lambda files: sorted(str(f.relative_to(tmp_path)) for f in files)  # noqa: E731
    assert names(text_files([tmp_path / "pkg"], ("_vendor", "tests"))) == ["pkg/a.py", "pkg/sub/d.py"]
    assert len(text_files([tmp_path / "pkg"])) == 4
    assert names(text_files([tmp_path / "pkg" / "_vendor"], ("_vendor",))) == ["pkg/_vendor/b.py"]  # named itself


def test_a_bench_mode_serves_the_eagle3_head_it_names(pair, tmp_path):
    """`+eagle3=PATH` in a bench mode: that head drafts in place of the config's, on the same
    loaded target, so two heads are compared side by side; a path with no head is named."""
    target, _ = pair
    save_eagle3(head_for(target.model), tmp_path / "ours")
    save_eagle3(head_for(target.model, draft_vocab=8, seed=1), tmp_path / "other")
    ours, theirs = bench_modes_naming("eagle3", target, tmp_path)
    assert ours.engine.drafter.model.config.draft_vocab_size == target.model.config.vocab_size
    assert theirs.engine.drafter.model.config.draft_vocab_size == 8
    assert_serves_losslessly(theirs, target)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="training on CUDA needs a CUDA device")


@needs_cuda
def test_the_training_loss_on_cuda_is_the_cpus(pair):
    """tools/train_eagle3.py --device cuda: the same chain starts give the same loss and gradients
    as on the CPU (every tensor the loss builds lives on the head's device)."""
    from engine.checkpoint import load_checkpoint

    sys.path.insert(0, str(ROOT / "tools"))
    from train_eagle3 import ttt_loss

    target, _ = pair
    on_cuda = load_checkpoint(target.path, "cuda", "float32", native_forward=False).model
    on_cpu = load_checkpoint(target.path, "cpu", "float32", native_forward=False).model
    tokens = torch.tensor([(p * 16)[:32] for p in PROMPTS])
    losses, grads = [], []
    for model, device in ((on_cpu, "cpu"), (on_cuda, "cuda")):
        head = head_for(target.model, draft_vocab=8).to(device).train().requires_grad_(True)
        loss, steps = ttt_loss(head, model, tokens.to(device), 6, 3, 0.8, torch.Generator().manual_seed(0), 2, 0.2)
        loss.backward()
        losses.append((loss.item(), steps))
        grads.append(head.fc.weight.grad.cpu())
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-3)
    assert losses[0][1] == pytest.approx(losses[1][1], rel=1e-3)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-5)
