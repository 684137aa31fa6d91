"""Speculative decoding is lossless: greedy output equals target-only output token for token,
sampled output follows the target's distribution, and rolled-back caches are clean."""

from __future__ import annotations

import random
import warnings
from collections import Counter

import pytest
import torch
from torch import nn

from engine.checkpoint import load_checkpoint
from engine.confidence import ConfidenceRule
from engine.core import Engine
from engine.drafters.draft_model import DraftModelDrafter, HybridDrafter, Int8Linear
from engine.drafters.ngram import LookupHistory, NgramDrafter, matched, ngram_hash, window_hashes
from engine.generate import generate
from engine.model.transformer import ForwardBatch
from engine.request import Request, Sequence
from engine.sampling import SamplingParams, target_probs
from tests.conftest import DEFAULT_DRAFT, tiny_pair

STEPS = (0, 1, 2, 3, 5, 7)
PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 9, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 8, 9], [20, 21]]
MAX_SEQ_LEN = 96


def make_drafter(kind: str, draft, max_batch_size: int):
    if kind.startswith("draft_model"):
        return DraftModelDrafter(draft, max_batch_size, MAX_SEQ_LEN, quantize=kind.endswith("int8"))
    if kind == "hybrid":
        return HybridDrafter(draft, max_batch_size, MAX_SEQ_LEN, min_n=1, max_n=3)
    return NgramDrafter(min_n=1, max_n=3)


def reference(target, prompts, params):
    return [c.tokens for c in generate(target, prompts, params)]


@pytest.mark.parametrize("kind", ["draft_model", "draft_model_int8", "ngram", "hybrid"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_output_equals_target_only_for_every_k(pair, kind, batch_size):
    target, draft = pair
    prompts = PROMPTS[:batch_size]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = reference(target, prompts, params)
    accepted = 0
    for k in STEPS:
        engine = Engine(target, make_drafter(kind, draft, batch_size), batch_size, MAX_SEQ_LEN, STEPS)
        requests = [Request(tuple(p), params) for p in prompts]
        outputs = engine.run_until_done(requests, k)
        assert [outputs[r.id] for r in requests] == expected, f"k={k}"
        accepted += engine.states[k].stats.drafts_accepted
        if k:
            assert engine.states[k].stats.drafts_proposed > 0
    assert accepted > 0  # speculation really happened, it did not just fall back to decoding


def test_an_int8_draft_runs_int8_weights_beside_the_checkpoints_own():
    """Quantizing the draft for one drafter leaves the loaded checkpoint as it was: a bench that
    serves the same draft both ways, side by side, runs each as asked."""
    draft = load_checkpoint(DEFAULT_DRAFT)
    int8 = DraftModelDrafter(draft, 1, MAX_SEQ_LEN, quantize=True)
    plain = DraftModelDrafter(draft, 1, MAX_SEQ_LEN)
    assert int8.model.native.weights.linears == torch.int8
    assert plain.model is draft.model and draft.model.native.weights.linears == torch.float32  # as loaded
    assert int8.model.embed_tokens.weight is draft.model.embed_tokens.weight  # no second copy of the parameters


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_greedy_output_of_a_target_quantized_in_groups_equals_its_target_only_output(pair, weights):
    """engine.weights serves the target from int8 or uint4 groups: speculation stays token for
    token what that model decodes alone, at every k and batch size, k changing between rounds."""
    target, draft = pair
    quantized = load_checkpoint(target.path, weights=weights)
    assert quantized.model.layers[0].mlp.gate_up.quantized is not None
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = reference(quantized, PROMPTS, params)
    for kind in ("draft_model_int8", "hybrid"):
        accepted = 0
        for k in STEPS:
            engine = Engine(quantized, make_drafter(kind, draft, 4), 4, MAX_SEQ_LEN, STEPS)
            requests = [Request(tuple(p), params) for p in PROMPTS]
            outputs = engine.run_until_done(requests, k)
            assert [outputs[r.id] for r in requests] == expected, (kind, k)
            accepted += engine.states[k].stats.drafts_accepted
        assert accepted > 0  # drafts were kept, not just decoded past
        engine = Engine(quantized, make_drafter(kind, draft, 4), 4, MAX_SEQ_LEN, STEPS)
        requests = [Request(tuple(p), params) for p in PROMPTS]
        for request in requests:
            engine.add_request(request)
        outputs, chooser = {r.id: [] for r in requests}, random.Random(7)
        while engine.has_work:
            for out in engine.step(chooser.choice(STEPS)).outputs:
                outputs[out.request_id].extend(out.new_tokens)
        assert [outputs[r.id] for r in requests] == expected, kind


@pytest.mark.parametrize("kind", ["draft_model", "draft_model_int8", "ngram", "hybrid"])
def test_greedy_stays_lossless_when_k_changes_at_every_boundary(pair, kind):
    target, draft = pair
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    expected = reference(target, PROMPTS, params)
    engine = Engine(target, make_drafter(kind, draft, 4), 4, MAX_SEQ_LEN, STEPS)
    requests = [Request(tuple(p), params) for p in PROMPTS]
    for request in requests:
        engine.add_request(request)
    outputs = {r.id: [] for r in requests}
    chooser = random.Random(5)
    seen = set()
    while engine.has_work:
        result = engine.step(chooser.choice(STEPS))
        seen.add(result.k)
        for out in result.outputs:
            outputs[out.request_id].extend(out.new_tokens)
    assert [outputs[r.id] for r in requests] == expected
    assert seen == set(STEPS)


def test_requests_arriving_mid_stream_are_lossless_and_reuse_slots(pair):
    target, draft = pair
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[3 + i, 4, 5 + i] for i in range(6)]
    expected = reference(target, prompts, params)
    engine = Engine(target, DraftModelDrafter(draft, 2, MAX_SEQ_LEN), 2, MAX_SEQ_LEN, [3])
    requests = [Request(tuple(p), params) for p in prompts]
    outputs = {r.id: [] for r in requests}
    pending = list(requests)
    while pending or engine.has_work:
        if pending:
            engine.add_request(pending.pop(0))  # one new arrival per boundary
        result = engine.step(3)
        assert result.batch_size <= 2
        for out in result.outputs:
            outputs[out.request_id].extend(out.new_tokens)
    assert [outputs[r.id] for r in requests] == expected
    assert engine.cache.free_slots == 2 and engine.drafter.cache.free_slots == 2


def test_eos_and_max_tokens_inside_an_accepted_run_stop_exactly(pair):
    target, _ = pair
    # The draft is the target itself: every draft is accepted, so stops fall inside long runs.
    free_run = reference(target, [PROMPTS[2]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    eos = free_run[9]
    target.eos_token_ids = frozenset({eos})
    try:
        for max_tokens in (5, 40):
            params = SamplingParams(max_tokens=max_tokens)
            expected = reference(target, [PROMPTS[2], PROMPTS[0]], params)
            engine = Engine(target, DraftModelDrafter(target, 1, MAX_SEQ_LEN), 1, MAX_SEQ_LEN, [7])
            requests = [Request(tuple(PROMPTS[2]), params), Request(tuple(PROMPTS[0]), params)]
            outputs = engine.run_until_done(requests)  # batch size 1: the second reuses the slot
            assert [outputs[r.id] for r in requests] == expected
            assert engine.states[7].stats.drafts_accepted == engine.states[7].stats.drafts_proposed
    finally:
        target.eos_token_ids = frozenset()
    assert expected[0][-1] == eos and len(expected[0]) == free_run.index(eos) + 1


def test_stop_string_inside_an_accepted_run(pair):
    target, _ = pair
    free_run = reference(target, [PROMPTS[0]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = target.tokenizer.decode(free_run[6:8])
    params = SamplingParams(max_tokens=30, stop=(stop,), ignore_eos=True)
    expected = reference(target, [PROMPTS[0]], params)[0]
    engine = Engine(target, DraftModelDrafter(target, 1, MAX_SEQ_LEN), 1, MAX_SEQ_LEN, [5])
    request = Request(tuple(PROMPTS[0]), params)
    assert engine.run_until_done([request])[request.id] == expected
    assert len(expected) < 30


@pytest.mark.parametrize("kind", ["draft_model", "hybrid"])
def test_caches_after_rollback_equal_a_fresh_prefill(pair, kind):
    target, draft = pair
    drafter = make_drafter(kind, draft, 4)
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, [5])
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for prompt in PROMPTS:
        engine.add_request(Request(tuple(prompt), params))
    for _ in range(6):
        engine.step(5)
    stats = engine.states[5].stats
    assert 0 < stats.drafts_accepted < stats.drafts_proposed  # there were rollbacks
    for seq in engine.running:
        copies = ((target.model, engine.cache, seq.slot), (draft.model, drafter.cache, seq.draft_slot))
        for model, cache, slot in copies:
            length = cache.lengths[slot]
            assert length <= len(seq.tokens) - 1
            fresh = model.new_cache(1, MAX_SEQ_LEN)
            fresh_slot = fresh.allocate()
            model(ForwardBatch.build(fresh, [fresh_slot], [seq.tokens[:length]]), fresh)
            keys, fresh_keys = cache.keys(slot)[:, :length], fresh.keys(fresh_slot)[:, :length]
            torch.testing.assert_close(keys, fresh_keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.v[:, slot, :length], fresh.v[:, fresh_slot, :length], atol=1e-5, rtol=0)
        assert engine.cache.lengths[seq.slot] == len(seq.tokens) - 1


class StepByStep:
    """Graphs that never fit a batch: the drafter then runs its forwards one at a time from Python."""

    def run(self, *args: object) -> None:
        return None


def test_the_compiled_greedy_chain_drafts_what_the_draft_model_step_by_step_does(pair):
    """Greedy chains of the draft model run whole in the kernels, one call a round: rows feeding
    different amounts (a prompt, then the round's kept tokens) and drafting different k draft
    exactly what forwards one at a time from Python do, and leave the same cache behind."""
    target, draft = pair
    if draft.model.native is None:
        pytest.skip("no compiled kernels here")
    compiled, stepped = DraftModelDrafter(draft, 3, MAX_SEQ_LEN), DraftModelDrafter(draft, 3, MAX_SEQ_LEN)
    stepped.graphs = StepByStep()
    drafts = []
    for drafter in (compiled, stepped):
        seqs = [Sequence(Request(tuple(p)), slot=i, generator=None, tokens=list(p)) for i, p in enumerate(PROMPTS[:3])]
        drafter.admit(seqs)
        first = drafter.propose(seqs, [5, 2, 1])
        # The target kept row 0's first draft and none of the others', then added a token of its own.
        for seq, proposal, own in zip(seqs, first, [1, 2, 3]):
            seq.tokens += [*proposal.tokens[: 1 if seq is seqs[0] else 0], own]
        drafter.accept(seqs, [1, 0, 0], {})
        second = drafter.propose(seqs, [3, 4, 0])
        drafts.append([p.tokens for p in first + second])
    assert [len(d) for d in drafts[0]] == [5, 2, 1, 3, 4, 0]
    assert drafts[0] == drafts[1]
    for slot in range(3):
        length = compiled.cache.lengths[slot]
        assert length == stepped.cache.lengths[slot] > 0
        torch.testing.assert_close(compiled.cache.keys(slot)[:, :length], stepped.cache.keys(slot)[:, :length])


def exact_marginals(target, prompt, params, positions: int) -> list[torch.Tensor]:
    """P(output token i = v) for i < positions, by enumerating every prefix."""
    model = target.model

    def next_probs(tokens):
        cache = model.new_cache(1, len(tokens))
        slot = cache.allocate()
        logits = model(ForwardBatch.build(cache, [slot], [tokens]), cache, last_only=True).logits[0, -1]
        return target_probs(logits, params)

    marginals = []
    prefixes = {(): 1.0}
    for _ in range(positions):
        step = torch.zeros(model.config.vocab_size, dtype=torch.float64)
        grown = {}
        for prefix, mass in prefixes.items():
            probs = next_probs(list(prompt) + list(prefix)).double()
            step += mass * probs
            for token in range(len(probs)):
                if probs[token] > 1e-6:
                    grown[(*prefix, token)] = mass * float(probs[token])
        marginals.append(step)
        prefixes = grown
    return marginals


def assert_follows_marginals(outputs, requests, marginals) -> None:
    """Chi-square of the 2nd and 3rd sampled tokens (both come out of verification)."""
    for position in (1, 2):
        counts = Counter(outputs[r.id][position] for r in requests)
        expected = marginals[position] * len(requests)
        observed = torch.tensor([counts[v] for v in range(len(expected))], dtype=torch.float64)
        keep = expected >= 5
        chi2 = float((((observed - expected) ** 2) / expected)[keep].sum())
        dof = int(keep.sum()) - 1
        # p < 0.001 for dof <= 7 is chi2 > 24.3: a real bias fails by far more than that.
        assert chi2 < 24.3, (position, chi2, dof, observed.tolist(), expected.tolist())


@pytest.mark.parametrize("verification", ["block", "token"])
@pytest.mark.parametrize("kind", ["draft_model", "draft_model_int8", "ngram", "hybrid"])
def test_sampling_under_speculation_keeps_the_target_distribution(tiny_vocab_pair, kind, verification):
    """Chi-square of the 2nd and 3rd sampled tokens (both come out of verification) against the
    target's exact marginals."""
    target, draft = tiny_vocab_pair
    prompt = tuple(range(8)) * 2  # every token has occurred: the n-gram drafter always proposes
    base = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True)
    with torch.inference_mode():
        marginals = exact_marginals(target, prompt, base, 3)
    draws = 1500
    engine = Engine(target, make_drafter(kind, draft, 16), 16, 32, [2], verification=verification)
    requests = [
        Request(prompt, SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True))
        for s in range(draws)
    ]
    outputs = engine.run_until_done(requests)
    stats = engine.states[2].stats
    assert 0 < stats.drafts_accepted < stats.drafts_proposed
    assert_follows_marginals(outputs, requests, marginals)


def run_with_random_row_ks(engine: Engine, requests: list[Request], seed: int) -> tuple[dict[str, list[int]], set]:
    """Serve `requests`, each round at a random state k and a random k of each row up to it."""
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list[int]] = {r.id: [] for r in requests}
    chooser, widths = random.Random(seed), set()
    states = sorted(engine.states)
    while engine.has_work:
        k = chooser.choice(states)
        row_ks = {s.request.id: chooser.randint(0, k) for s in engine.running}
        result = engine.step(k, row_ks=row_ks)
        widths.add(tuple(sorted(o.drafts_proposed for o in result.outputs if o.verified)))
        for out in result.outputs:
            outputs[out.request_id].extend(out.new_tokens)
    return outputs, widths


@pytest.mark.parametrize("kind", ["draft_model", "ngram", "hybrid"])
@pytest.mark.parametrize("batch_size", [1, 4, 8])
def test_greedy_stays_lossless_when_every_row_drafts_its_own_k(pair, kind, batch_size):
    """A round whose rows each take their own k (random per row, per round) emits what
    target-only decoding does, token for token."""
    target, draft = pair
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(batch_size)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = reference(target, prompts, params)
    engine = Engine(target, make_drafter(kind, draft, batch_size), batch_size, MAX_SEQ_LEN, STEPS)
    requests = [Request(tuple(p), params) for p in prompts]
    outputs, widths = run_with_random_row_ks(engine, requests, seed=batch_size)
    assert [outputs[r.id] for r in requests] == expected
    if batch_size > 1:
        assert any(len(set(w)) > 1 for w in widths)  # rows of one verify really drafted different k
    assert sum(s.stats.drafts_accepted for s in engine.states.values()) > 0


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_sampling_keeps_the_target_distribution_when_every_row_drafts_its_own_k(tiny_vocab_pair, kind):
    """Chi-square of the sampled tokens against the target's exact marginals, the rows of each
    round drafting random k of their own."""
    target, draft = tiny_vocab_pair
    prompt = tuple(range(8)) * 2
    base = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True)
    with torch.inference_mode():
        marginals = exact_marginals(target, prompt, base, 3)
    engine = Engine(target, make_drafter(kind, draft, 16), 16, 32, [0, 1, 2, 3])
    requests = [
        Request(prompt, SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True))
        for s in range(1500)
    ]
    outputs, widths = run_with_random_row_ks(engine, requests, seed=11)
    assert any(len(set(w)) > 2 for w in widths)
    assert sum(s.stats.drafts_accepted for s in engine.states.values()) > 0
    assert_follows_marginals(outputs, requests, marginals)


def test_state_for_a_new_k_is_built_between_rounds_and_selected_at_a_boundary(pair):
    target, draft = pair
    engine = Engine(target, DraftModelDrafter(draft, 2, MAX_SEQ_LEN), 2, MAX_SEQ_LEN, [1, 3])
    assert sorted(engine.states) == [1, 3]
    assert all(s.build_seconds > 0 for s in engine.states.values())
    with pytest.raises(KeyError, match="no runtime state for draft length 4"):
        engine.step(4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    request = Request(tuple(PROMPTS[0]), params)
    engine.add_request(request)
    engine.step(3)
    engine.build_state(4)
    assert engine.state(4).k == 4
    out = engine.step(4)
    assert out.k == 4 and out.outputs[0].drafts_proposed == 4
    with pytest.raises(ValueError, match="outside 0..8"):
        engine.build_state(9)


def test_cancel_frees_the_slot_at_the_next_boundary(pair):
    target, draft = pair
    engine = Engine(target, DraftModelDrafter(draft, 1, MAX_SEQ_LEN), 1, MAX_SEQ_LEN, [3])
    long = Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=80, ignore_eos=True))
    short = Request(tuple(PROMPTS[1]), SamplingParams(max_tokens=10, ignore_eos=True))
    engine.add_request(long)
    engine.add_request(short)
    engine.step(3)
    engine.cancel(long.id)
    outputs = {long.id: [], short.id: []}
    reasons = {}
    while engine.has_work:
        for out in engine.step(3).outputs:
            outputs[out.request_id].extend(out.new_tokens)
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {long.id: "cancelled", short.id: "length"}
    assert outputs[short.id] == reference(target, [PROMPTS[1]], short.params)[0]


def test_bad_requests_are_refused_with_a_reason(pair):
    target, _ = pair
    engine = Engine(target, None, 1, 32, [0])
    with pytest.raises(ValueError, match="exceeds max_seq_len 32"):
        engine.add_request(Request((1, 2, 3), SamplingParams(max_tokens=30)))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request(Request((), SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(Request((1, 999), SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="needs a drafter"):
        engine.build_state(3)


@pytest.fixture(scope="module")
def operator_pair(tmp_path_factory):
    """The tiny pair on PyTorch operators, whose ragged batches may attend a row at a time."""
    return tiny_pair(tmp_path_factory.mktemp("operators"), native_forward=False)


@pytest.mark.parametrize("kind", ["draft_model", "hybrid"])
@pytest.mark.parametrize("attention", ["compiled", "as_estimated", "by_row"])
def test_greedy_stays_lossless_when_the_chains_of_a_batch_are_ragged(pair, operator_pair, kind, attention, monkeypatch):
    """Requests near their max_tokens draft fewer tokens than k, so one verify holds chains of
    different lengths: same text, on the compiled forward and on PyTorch operators, whether their
    ragged verifies attend padded or a row at a time (short contexts stay padded unless told
    otherwise)."""
    target, draft = pair if attention == "compiled" else operator_pair
    by_row_batches = []

    def rows_always_cheaper(*_: object) -> bool:
        by_row_batches.append(1)
        return True

    if attention == "by_row":
        monkeypatch.setattr(ForwardBatch, "_rows_cheaper", staticmethod(rows_always_cheaper))
    lengths = [3, 5, 9, 48]  # with k = 7, the first verify holds chains of 1, 3, 7 and 7 drafts
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    expected = [reference(target, [p], q)[0] for p, q in zip(PROMPTS, params)]
    engine = Engine(target, make_drafter(kind, draft, 4), 4, MAX_SEQ_LEN, [7])
    requests = [Request(tuple(p), q) for p, q in zip(PROMPTS, params)]
    outputs: dict[str, list[int]] = {r.id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    chain_lengths = []
    while engine.has_work:
        result = engine.step(7)
        chain_lengths.append(sorted(o.drafts_proposed for o in result.outputs if o.verified))
        for out in result.outputs:
            outputs[out.request_id].extend(out.new_tokens)
    assert [outputs[r.id] for r in requests] == expected
    assert any(len(set(lengths)) > 2 for lengths in chain_lengths)
    assert bool(by_row_batches) == (attention == "by_row")


def latest_continuation(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by scanning the context: the reference the n-gram index must agree with.
    What followed the match is read from the context extended by the proposal itself, so a match
    d tokens back repeats with period d past the end of the context."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[len(tokens) :]
    return []


def test_ngram_lookup_proposes_what_followed_the_latest_longest_match_as_the_context_grows():
    rng = random.Random(0)
    for _ in range(100):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        drafter = NgramDrafter(min_n, max_n)
        seq = Sequence(Request((1,)), slot=0, generator=None, tokens=[rng.randint(0, 4)])
        drafter.admit([seq])
        for _ in range(40):
            seq.tokens += [rng.randint(0, 4) for _ in range(rng.randint(1, 3))]  # a round's tokens
            k = rng.randint(1, 6)
            expected = latest_continuation(seq.tokens, k, min_n, max_n)
            assert drafter.propose([seq], [k])[0].tokens == expected


def test_the_ngram_drafter_forgets_a_sequence_that_left(pair):
    target, _ = pair
    drafter = NgramDrafter(1, 3)
    engine = Engine(target, drafter, 2, MAX_SEQ_LEN, STEPS)
    engine.run_until_done([Request(tuple(p), SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS], 3)
    assert drafter.indexes == {}


@pytest.mark.parametrize("bias", [False, True])
def test_the_int8_draft_layer_computes_what_torch_ao_dynamic_quantization_does(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    linear.qconfig = torch.ao.quantization.default_dynamic_qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = torch.ao.nn.quantized.dynamic.Linear.from_float(linear)
    layer = Int8Linear(linear)
    for rows in (1, 4, 13):
        x = torch.randn(rows, 48) * 3
        assert torch.equal(layer(x), reference(x))
    # Quantization moved the weights, so this is not the float layer.
    assert not torch.allclose(layer(x), linear(x), atol=1e-6)


def test_an_int8_draft_of_a_bfloat16_checkpoint_drafts_into_a_cache_of_its_own_dtype(pair):
    target, draft = pair
    bf16_target, bf16_draft = (load_checkpoint(c.path, dtype="bfloat16") for c in (target, draft))
    drafter = DraftModelDrafter(bf16_draft, 2, MAX_SEQ_LEN, quantize=True)
    assert drafter.cache.k[0].dtype == torch.float32  # the int8 layers compute in float32
    engine = Engine(bf16_target, drafter, 2, MAX_SEQ_LEN, STEPS)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    requests = [Request(tuple(p), params) for p in PROMPTS[:2]]
    outputs = engine.run_until_done(requests, 3)
    assert [len(outputs[r.id]) for r in requests] == [12, 12]
    assert engine.states[3].stats.drafts_accepted > 0


def test_the_hybrid_drafter_proposes_a_greedy_sequences_own_continuation_without_the_model(pair):
    target, draft = pair
    drafter = HybridDrafter(draft, 4, MAX_SEQ_LEN, min_n=1, max_n=3)
    greedy, sampled = SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    repeating = [3, 4, 5, 6, 7, 3, 4]  # seen before: 3, 4 was followed by 5, 6, 7, then 3, 4 again
    seqs = [
        Sequence(Request(tuple(repeating), greedy), slot=0, generator=None, tokens=list(repeating)),
        Sequence(
            Request(tuple(repeating), sampled),
            slot=1,
            generator=sampled.generator(torch.device("cpu")),
            tokens=list(repeating),
        ),
        Sequence(Request((20, 21), greedy), slot=2, generator=None, tokens=[20, 21]),  # 21 never seen before
    ]
    drafter.admit(seqs)
    fed = [drafter.cache.lengths[s.draft_slot] for s in seqs]
    proposals = drafter.propose(seqs, [3, 3, 3])
    assert proposals[0].tokens == [5, 6, 7] and proposals[0].probs is None
    assert drafter.cache.lengths[seqs[0].draft_slot] == fed[0]  # the model did not run for it
    # A sampled sequence, and one whose context has no match, draft with the model.
    assert proposals[1].probs is not None and len(proposals[1].tokens) == 3
    assert len(proposals[2].tokens) == 3 and proposals[2].probs is None
    assert drafter.cache.lengths[seqs[2].draft_slot] > fed[2]
    for seq in seqs:
        drafter.release(seq)
    assert drafter.lookups.indexes == {} and drafter.cache.free_slots == 4


def test_a_lookup_that_runs_into_the_end_of_the_context_repeats_with_its_period():
    drafter = NgramDrafter(1, 3)
    seq = Sequence(Request((1,)), slot=0, generator=None, tokens=[9, 1, 2, 1, 2])
    drafter.admit([seq])
    # [1, 2] last occurred two tokens back: what followed it is the context's end, then itself.
    assert drafter.propose([seq], [5])[0].tokens == [1, 2, 1, 2, 1]


def test_lookup_history_finds_what_a_scan_of_the_texts_it_holds_finds():
    """Newest text first, the longest indexed n-gram ending the context that occurs with a token
    after it (its latest occurrence there): what the hashed index must agree with."""
    rng = random.Random(4)
    history = LookupHistory(capacity=300)
    for _ in range(12):
        history.add([rng.randrange(4) for _ in range(rng.randint(30, 80))])
        for _ in range(40):
            context = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
            expected: tuple[list[int], int] = ([], 0)
            for n in (n for n in history.spans if n <= len(context)):
                hits = [
                    (text, start)
                    for text in reversed(list(history.texts.values()))
                    for start in range(len(text) - n - 1, -1, -1)
                    if list(text[start : start + n]) == context[-n:]
                ]
                if hits:
                    text, start = hits[0]
                    expected = (list(text[start + n : start + n + 3]), matched(context, text, start + n))
                    break
            assert history.continuation(context, 3) == expected
    text = [rng.randrange(49152) for _ in range(70)]  # every window's hash, taken at once, as one n-gram's
    windows = window_hashes(text, history.spans)
    assert all(int(windows[n][s]) == ngram_hash(text[s : s + n]) for n in history.spans for s in range(71 - n))


def test_lookup_history_finds_the_longest_indexed_match_and_forgets_the_oldest_text():
    history = LookupHistory(capacity=100)
    first = list(range(100, 160))
    history.add(first)
    # 20 tokens of the first text at the end of an unrelated context: the 16-gram is found, and
    # the match reaches back to where the contexts part.
    assert history.continuation([1, 2, *first[10:30]], 5) == (first[30:35], 20)
    assert history.continuation([1, 2, 3], 5) == ([], 0)  # shorter than the shortest n-gram indexed
    history.add(list(range(200, 260)))  # 120 tokens held: the first text goes
    assert history.size == 60 and list(history.texts) == [1]
    assert history.continuation(first[10:30], 5) == ([], 0)
    assert history.continuation(list(range(200, 220)), 3) == ([220, 221, 222], 20)
    assert len(history.starts) == sum(60 - n for n in history.spans)  # nothing of the first is left


def test_an_earlier_sequence_is_looked_up_where_it_matches_longer_than_the_own_context():
    drafter = NgramDrafter(1, 4, history=1000)
    earlier = Sequence(Request((1,)), slot=0, generator=None, tokens=[50, 51, 52, 53, 54, 55, 56, 57, 58, 59])
    drafter.admit([earlier])
    drafter.release(earlier)
    # Its own context has [53, 54, 55] once before (a 3-gram match); the earlier sequence has all
    # six last tokens, and what followed them.
    seq = Sequence(Request((1,)), slot=1, generator=None, tokens=[53, 54, 55, 9, 52, 53, 54, 55])
    drafter.admit([seq])
    assert drafter.lookup(seq, 3) == ([56, 57, 58], 4)
    # Where the own context matches at least as long, it wins: it is the sequence's own text.
    own = Sequence(Request((1,)), slot=2, generator=None, tokens=[52, 53, 54, 55, 7, 52, 53, 54, 55])
    drafter.admit([own])
    assert drafter.lookup(own, 3) == ([7, 52, 53], 4)
    # A sampled sequence looks in its own context only: its draws, and so a seed's text, must not
    # depend on what other requests wrote.
    sampled = Sequence(Request((1,), SamplingParams(temperature=0.8)), slot=3, generator=None, tokens=seq.tokens)
    drafter.admit([sampled])
    assert drafter.lookup(sampled, 3) == ([9, 52, 53], 3)


def test_a_seed_repeats_its_text_at_a_fixed_k_whatever_the_lookup_history_holds(pair):
    target, _ = pair
    engine = Engine(target, NgramDrafter(1, 3, history=4096), 4, MAX_SEQ_LEN, STEPS)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)
    texts = []
    for _ in range(2):  # the second time, the history holds the first one's text
        request = Request(tuple(PROMPTS[2]), params)
        texts.append(engine.run_until_done([request], 3)[request.id])
    assert texts[0] == texts[1]


def test_a_repeated_request_drafts_what_the_first_one_wrote_and_stays_lossless(pair):
    target, draft = pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = reference(target, PROMPTS, params)
    drafter = HybridDrafter(draft, 4, MAX_SEQ_LEN, min_n=1, max_n=3, history=4096)
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, STEPS)
    rounds = []
    for _ in range(2):
        requests = [Request(tuple(p), params) for p in PROMPTS]
        started = engine.round
        outputs = engine.run_until_done(requests)
        assert [outputs[r.id] for r in requests] == expected
        rounds.append(engine.round - started)
    assert rounds[1] < rounds[0]  # the second time, every chain was what the target writes


def test_a_lookups_confidence_is_how_often_drafts_after_as_long_a_match_were_kept():
    """A weak lookup (its match one token long) that the target keeps rejecting is cut by the floor
    before the target sees it; a strong one (eight tokens or more) that it keeps is verified whole."""
    drafter = NgramDrafter(1, 4)
    floor = ConfidenceRule(0.1)
    weak = Sequence(Request((9,)), slot=0, generator=None, tokens=[1, 2, 3, 4, 5, 6, 9, 1])  # "1" seen once
    strong = Sequence(Request((9,)), slot=1, generator=None, tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8])
    drafter.admit([weak, strong])
    first = drafter.propose([weak, strong], [4, 4])
    assert [p.tokens for p in first] == [[2, 3, 4, 5], [9, 1, 2, 3]]
    assert first[0].confidence == first[1].confidence  # nothing counted yet: the prior alone
    for _ in range(20):
        weak_draft, strong_draft = drafter.propose([weak, strong], [4, 4])
        drafter.accept([weak, strong], [0, len(strong_draft.tokens)])
    weak_draft, strong_draft = drafter.propose([weak, strong], [4, 4])
    assert weak_draft.confidence[0] < 0.1 < 0.9 < strong_draft.confidence[-1]
    for proposal in (weak_draft, strong_draft):
        proposal.cut(floor)
    assert weak_draft.tokens == [] and strong_draft.tokens == [9, 1, 2, 3]
    # Only what a round verified is counted: a draft cut before the target saw it says nothing.
    drafter.accept([weak], [0])
    assert drafter.chances.reached[(True, 1)][2:] == [0.0] * 3
    drafter.release(weak)
    drafter.release(strong)
    assert drafter.proposed == {}


def test_lookups_cut_by_their_confidence_stay_lossless_and_verify_fewer_drafts(pair):
    from control.schema import policy_params
    from engine.controller import Controller

    target, _ = pair
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    verified = {}
    for floor in (0.0, 0.3):
        policy = policy_params(strategy="positional", candidate_k=(0, 3, 5), draft_confidence=floor)
        controller = Controller(Engine(target, NgramDrafter(1, 4), 4, MAX_SEQ_LEN, (0, 3, 5)), policy)
        requests = [Request(tuple(p), params) for p in PROMPTS]
        for request in requests:
            controller.engine.add_request(request)
        outputs: dict[str, list[int]] = {r.id: [] for r in requests}
        drafts = rounds = 0
        while controller.engine.has_work:
            result = controller.step()
            for out in result.outputs:
                outputs[out.request_id] += out.new_tokens
                drafts += out.drafts_proposed if out.verified else 0
            rounds += bool(result.batch_size)
        assert [outputs[r.id] for r in requests] == expected
        verified[floor] = drafts / rounds
    assert verified[0.3] < verified[0.0]
