"""The DFlash block drafter: lossless at every k and under switching, its confidence cut, its
context cache in step with the target, its compiled kernels equal to its PyTorch operators. Its
checkpoints, config and benches: test_dflash_checkpoints.py; its training script:
test_dflash_training.py."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from daemon.metrics import Metrics
from engine.confidence import EVERY_DRAFT, ConfidenceRule
from engine.core import Engine
from engine.drafters.base import Proposal
from engine.drafters.dflash import DFlashDrafter, HybridDFlashDrafter
from engine.generate import generate
from engine.model.config import DFlashConfig
from engine.model.dflash import DFlashModel, default_taps
from engine.request import Request, Sequence
from engine.sampling import SamplingParams
from tests.test_speculative import MAX_SEQ_LEN, PROMPTS, assert_follows_marginals, exact_marginals

BLOCK = 6


def dflash_for(
    target,
    block_size: int = BLOCK,
    seed: int = 0,
    draft_vocab: int = 0,
    short_blocks: bool = False,
    window: int | None = None,
) -> DFlashModel:
    """An untrained drafter shaped for `target`: its drafts are mostly wrong, which is what the
    losslessness tests need (every kind of rejection happens). With `draft_vocab`, it drafts
    only that many ids of the target's, drawn at random."""
    tc = target.config
    config = DFlashConfig(
        hidden_size=tc.hidden_size,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=tc.vocab_size,
        block_size=block_size,
        target_layer_ids=default_taps(tc.num_layers, 2),
        mask_token_id=tc.vocab_size - 1,
        draft_vocab_size=draft_vocab,
        short_blocks=short_blocks,
        sliding_window=window,
    )
    torch.manual_seed(seed)
    model = DFlashModel(config).eval().requires_grad_(False)
    if draft_vocab:
        ids = torch.randperm(tc.vocab_size)[:draft_vocab].sort().values
        model.d2t.copy_(ids - torch.arange(draft_vocab))
    return model


def engine_for(
    target,
    batch: int,
    ks=(0, 1, 2, 3, 5),
    quantize: bool = False,
    window: int | None = None,
) -> Engine:
    model = dflash_for(target.model, window=window)
    drafter = DFlashDrafter(model, target.model, batch, MAX_SEQ_LEN, quantize=quantize)
    assert drafter.native is not None and (drafter.native.weights.linears == torch.int8) == quantize
    return Engine(target, drafter, batch, MAX_SEQ_LEN, ks)


def serve_switching(
    engine: Engine, params: SamplingParams, seed: int, rule: ConfidenceRule = EVERY_DRAFT
) -> list[list[int]]:
    """Every prompt's output, served together with k drawn at random at every boundary, each
    round's drafts cut by `rule`."""
    rng = random.Random(seed)
    requests = [Request(tuple(p), params) for p in PROMPTS]
    outputs: dict[str, list[int]] = {r.id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_work:
        for out in engine.step(rng.choice([0, 1, 2, 3, 5]), rule).outputs:
            outputs[out.request_id].extend(out.new_tokens)
    return [outputs[r.id] for r in requests]


def assert_serves_losslessly(controller, target) -> None:
    """Two prompts served through the controller, its policy choosing k: target-only's output."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    requests = [Request(tuple(p), params) for p in PROMPTS[:2]]
    for r in requests:
        controller.engine.add_request(r)
    outputs: dict[str, list[int]] = {r.id: [] for r in requests}
    while controller.engine.has_work:
        for out in controller.step().outputs:
            outputs[out.request_id].extend(out.new_tokens)
    assert [outputs[r.id] for r in requests] == [c.tokens for c in generate(target, PROMPTS[:2], params)]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_target_only_for_every_k(pair, batch):
    target, _ = pair
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = PROMPTS[:batch]
    expected = [c.tokens for c in generate(target, prompts, params)]
    for k in (0, 1, 2, 3, 5):
        engine = engine_for(target, batch, (k,))
        requests = [Request(tuple(p), params) for p in prompts]
        outputs = engine.run_until_done(requests, k)
        assert [outputs[r.id] for r in requests] == expected, f"k={k}"
        if k:
            assert engine.states[k].stats.drafts_proposed > 0


@pytest.mark.parametrize(
    "quantize, window", [(False, None), (True, None), (False, 9)], ids=["as loaded", "int8", "window"]
)
def test_greedy_stays_lossless_when_k_changes_at_every_boundary(pair, quantize, window):
    target, _ = pair
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    assert serve_switching(engine_for(target, 4, quantize=quantize, window=window), params, seed=0) == expected


def test_a_drafter_with_its_own_vocabulary_drafts_only_its_ids_and_stays_lossless(pair):
    """A drafter over a subset of the target's ids (its LM head: those rows of the target's) drafts
    nothing else, its greedy drafts are the argmax over them, and the output is target-only's
    with k changed at random every round."""
    target, _ = pair
    model = dflash_for(target.model, draft_vocab=40)
    allowed = set(model.draft_to_target().tolist())
    assert len(allowed) == 40
    drafter = DFlashDrafter(model, target.model, 4, MAX_SEQ_LEN)
    drafted: list[int] = []
    propose = drafter.propose
    drafter.propose = lambda *a: [drafted.extend(p.tokens) or p for p in propose(*a)]  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    assert serve_switching(Engine(target, drafter, 4, MAX_SEQ_LEN, (0, 1, 2, 3, 5)), params, seed=1) == expected
    assert drafted and set(drafted) <= allowed
    full = DFlashModel(model.config.__class__(**{**model.config.__dict__, "draft_vocab_size": 0}))
    full.load_state_dict({k: v for k, v in model.state_dict().items() if k != "d2t"})
    full.eval().requires_grad_(False)
    block = torch.full((1, BLOCK), model.config.mask_token_id)
    block[0, 0] = PROMPTS[0][-1]
    positions = torch.arange(BLOCK)[None, :]
    empty = torch.zeros(1, 0, model.config.num_kv_heads, model.config.head_dim)
    mask = torch.ones(1, 1, BLOCK, BLOCK, dtype=torch.bool)
    with torch.inference_mode():
        reduced = model(block, positions, [empty] * 2, [empty] * 2, mask, target.model)
        whole = full(block, positions, [empty] * 2, [empty] * 2, mask, target.model)
    assert torch.allclose(reduced, whole[..., model.draft_to_target()], atol=1e-5)


def test_a_confidence_floor_verifies_only_the_drafts_the_drafter_is_sure_of(pair):
    """With a ConfidenceRule, a round verifies a row's drafts while the product of the drafter's
    probabilities of them (the confidence a block reports: a running product) stays at or above
    the floor: unsure blocks verify fewer, the output is target-only's all the same."""
    target, _ = pair
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    engine = engine_for(target, 4, (5,))
    seen: list[tuple[list[float], int]] = []  # each row's confidences and the drafts it verified
    propose, block_logits = engine.drafter.propose, engine.drafter.block_logits
    blocks: list[torch.Tensor] = []  # the logits of each block drafted
    engine.drafter.block_logits = lambda *args: blocks.append(block_logits(*args)) or blocks[-1]

    def recording(seqs, ks, *rest):
        proposals = propose(seqs, ks, *rest)
        seen.extend((list(p.confidence), len(p.tokens)) for p in proposals if p.confidence)
        # Each draft's confidence: the product of the drafter's largest probabilities up to it.
        tops = blocks[-1].softmax(dim=-1).amax(dim=-1).tolist()
        for top, p in zip(tops, [p for p in proposals if p.tokens]):
            running = [math.prod(top[: j + 1]) for j in range(len(p.tokens))]
            assert p.confidence == pytest.approx(running, rel=1e-5)
        return proposals

    engine.drafter.propose = recording
    requests = [Request(tuple(p), params) for p in PROMPTS]
    engine.run_until_done(requests)  # no floor: every row verifies its 5 drafts
    assert seen and all(n == len(c) for c, n in seen) and max(n for _, n in seen) == 5
    chances = sorted(c[1] for c, _ in seen if len(c) >= 2)
    floor = chances[len(chances) // 2]  # the median chance of the first two drafts

    engine = engine_for(target, 4, (5,))
    rule = ConfidenceRule(floor)
    for cut_at, kept in ((0.4, 3), (0.5, 1)):  # reported confidences are running products: 0.9 x 0.5 x 0.9 ...
        trimmed = Proposal([1, 2, 3, 4, 5], torch.eye(5), confidence=[0.9, 0.45, 0.405, 0.0405, 0.03645])
        trimmed.cut(ConfidenceRule(cut_at))
        assert trimmed.tokens == [1, 2, 3][:kept] and trimmed.confidence == [0.9, 0.45, 0.405][:kept]
        assert trimmed.trimmed == 5 - kept and torch.equal(trimmed.probs, torch.eye(5)[:kept])
    drafted: list[tuple[Proposal, list[float]]] = []  # each proposal, and its confidences before the trim
    propose = engine.drafter.propose

    def recording_again(seqs, ks, *rest):
        proposals = propose(seqs, ks, *rest)
        drafted.extend((p, list(p.confidence or [])) for p in proposals)
        return proposals

    engine.drafter.propose = recording_again
    requests = [Request(tuple(p), params) for p in PROMPTS]
    outputs: dict[str, list[int]] = {r.id: [] for r in requests}
    metrics = Metrics(max_k=5)
    for r in requests:
        engine.add_request(r)
    while engine.has_work:
        result = engine.step(5, rule)
        metrics.observe_step(result)
        for out in result.outputs:
            outputs[out.request_id].extend(out.new_tokens)
    assert [outputs[r.id] for r in requests] == expected
    verified = engine.states[5].stats.proposed_at
    assert verified[0] > verified[1] > 0, "some rounds verify fewer drafts, others more"
    for proposal, chances in drafted:  # each draft's confidence: already the running product
        n = len(proposal.tokens)
        assert all(c >= floor for c in chances[:n]) and all(c < floor for c in chances[n : n + 1])
    trimmed = sum(len(confidence) - len(proposal.tokens) for proposal, confidence in drafted)
    assert trimmed > 0 and f"adaspec_trimmed_drafts_total {trimmed}.0" in metrics.exposition().decode()


def test_the_floor_applies_while_the_policy_adapts_never_to_a_pinned_k(pair):
    from control.schema import policy_params
    from engine.controller import Controller, Pin, Unpin

    target, _ = pair
    params = policy_params(strategy="measured", candidate_k=(0, 2, 5), draft_confidence=0.5)
    controller = Controller(engine_for(target, 4, (0, 2, 5)), params)
    floors = []  # the floor each round ran with: the rule the controller passed the engine
    step = controller.engine.step

    def recording(k, rule=EVERY_DRAFT, row_ks=None):
        floors.append(rule.floor)
        return step(k, rule, row_ks)

    controller.engine.step = recording
    controller.apply(Pin(5))
    assert_serves_losslessly(controller, target)
    controller.apply(Unpin())
    assert_serves_losslessly(controller, target)
    pinned = floors[: floors.index(0.5)]
    assert pinned and set(pinned) == {0.0} and set(floors[len(pinned) :]) == {0.5}


def block_widths(drafter: DFlashDrafter) -> dict[int, set[int]]:
    """The widths of the blocks the drafter runs from now on, by the drafts asked of them."""
    widths: dict[int, set[int]] = {}
    block_logits = drafter.block_logits

    def spy(slots, block, drafts):
        widths.setdefault(drafts, set()).add(block.shape[1])
        return block_logits(slots, block, drafts)

    drafter.block_logits = spy  # type: ignore[method-assign]
    return widths


def test_a_drafter_trained_on_short_blocks_drafts_k_from_a_block_of_k_plus_1(pair):
    """Such a drafter's block is as long as the round's longest chain needs (k + 1 positions, not
    the whole block), and the output stays target-only's with k changed at random every round."""
    target, _ = pair
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    widths = {}
    for short_blocks in (True, False):
        drafter = DFlashDrafter(dflash_for(target.model, short_blocks=short_blocks), target.model, 4, MAX_SEQ_LEN)
        widths[short_blocks] = block_widths(drafter)
        engine = Engine(target, drafter, 4, MAX_SEQ_LEN, (0, 1, 2, 3, 5))
        assert serve_switching(engine, params, seed=2) == expected
    assert widths[True] == {1: {2}, 2: {3}, 3: {4}, 5: {6}}
    assert widths[False] == {1: {BLOCK}, 2: {BLOCK}, 3: {BLOCK}, 5: {BLOCK}}  # trained on whole blocks only


def test_lookups_in_front_of_dflash_stay_lossless_and_spare_its_forwards(pair):
    """hybrid_dflash: lookups propose where the context has seen the last tokens, the block
    drafter elsewhere; k changed at random every round, output equal to target-only."""
    target, _ = pair
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    drafter = HybridDFlashDrafter(dflash_for(target.model), target.model, 4, MAX_SEQ_LEN)
    forwards, lookups = [], []
    block_logits, lookup = drafter.block_logits, drafter.lookups.propose
    drafter.block_logits = lambda *args: forwards.append(args) or block_logits(*args)  # type: ignore[method-assign]
    drafter.lookups.propose = lambda *args: lookups.append(lookup(*args)) or lookups[-1]  # type: ignore[method-assign]
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, (0, 1, 2, 3, 5))
    assert serve_switching(engine, params, seed=1) == expected
    assert sum(state.stats.drafts_proposed for state in engine.states.values()) > 0
    assert all(state.stats.drafts_proposed > 0 for k, state in engine.states.items() if k and state.stats.rounds)
    # Both proposed: some rows' drafts were looked up, others drafted by the block drafter.
    assert any(p.tokens for found in lookups for p in found) and forwards


def test_the_context_cache_follows_the_target_and_rolls_back_exactly(pair):
    """After rounds of drafting and rejection, the drafter's context keys and values equal those
    built fresh from the target's own forward over the same tokens."""
    target, _ = pair
    engine = engine_for(target, 1, (3,))
    request = Request(tuple(PROMPTS[2]), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request(request)
    for _ in range(4):
        engine.step(3)
    (seq,) = engine.running
    drafter: DFlashDrafter = engine.drafter  # type: ignore[assignment]
    length = drafter.cache.lengths[seq.draft_slot]
    assert length == len(seq.tokens) - 1  # the context lags the newest token by one

    fresh_cache = target.model.new_cache(1, MAX_SEQ_LEN)
    slot = fresh_cache.allocate()
    batch = target.model.batch(fresh_cache, [slot], [seq.tokens[:-1]])
    taps = target.model(batch, fresh_cache, capture=drafter.capture_layers).hidden
    fresh = DFlashDrafter(drafter.model, target.model, 1, MAX_SEQ_LEN)
    twin = type(seq)(request, slot=0, generator=None, tokens=list(seq.tokens))
    fresh.admit([twin], taps)
    built, rebuilt = drafter.cache.keys(seq.draft_slot), fresh.cache.keys(twin.draft_slot)
    assert torch.allclose(built[:, :length], rebuilt[:, :length], atol=1e-4)
    assert torch.allclose(
        drafter.cache.v[:, seq.draft_slot, :length], fresh.cache.v[:, twin.draft_slot, :length], atol=1e-4
    )


@pytest.mark.parametrize("draft_vocab, window", [(0, None), (40, None), (0, 7)])
def test_the_compiled_drafter_computes_what_the_pytorch_one_does(pair, tmp_path, draft_vocab, window):
    """On a CPU the drafter runs on the compiled kernels beside a compiled target: its context and
    its block logits equal those of the PyTorch operators, rows of different lengths in one batch
    (and within a sliding window shorter than the longer row's context and block)."""
    from tests.conftest import tiny_pair

    target, _ = pair
    if target.model.native is None:
        pytest.skip("no compiled kernels here")
    plain, _ = tiny_pair(tmp_path, native_forward=False)  # the same weights (seeded), on PyTorch operators
    model = dflash_for(target.model, draft_vocab=draft_vocab, window=window)
    prompts = [PROMPTS[0], PROMPTS[2][:7]]
    drafters = []
    served_models = [(target, model), (plain, model)]
    if window:  # and the same drafter unwindowed, on PyTorch operators
        unwindowed = DFlashModel(replace(model.config, sliding_window=None)).eval()
        unwindowed.load_state_dict(model.state_dict())
        served_models.append((plain, unwindowed))
    for served, drafted_by in served_models:
        drafter = DFlashDrafter(drafted_by, served.model, 2, MAX_SEQ_LEN)
        cache = served.model.new_cache(2, MAX_SEQ_LEN)
        slots = [cache.allocate() for _ in prompts]
        taps = served.model(served.model.batch(cache, slots, prompts), cache, capture=drafter.capture_layers).hidden
        seqs = [Request(tuple(p), SamplingParams()) for p in prompts]
        twins = [Sequence(r, slot=i, generator=None, tokens=list(p)) for i, (r, p) in enumerate(zip(seqs, prompts))]
        drafter.admit(twins, taps)
        drafters.append((drafter, twins))
    (compiled, rows), (reference, rows_ref) = drafters[:2]
    assert compiled.native is not None and reference.native is None
    lengths = [len(p) - 1 for p in prompts]
    assert [compiled.cache.lengths[t.draft_slot] for t in rows] == lengths
    for row, ref_row, length in zip(rows, rows_ref, lengths):
        keys, ref_keys = compiled.cache.keys(row.draft_slot), reference.cache.keys(ref_row.draft_slot)
        assert torch.allclose(keys[:, :length], ref_keys[:, :length], atol=1e-4)
    block = torch.full((2, BLOCK), model.config.mask_token_id)
    block[:, 0] = torch.tensor([p[-1] for p in prompts])
    logits = compiled.block_logits([t.draft_slot for t in rows], block, BLOCK - 1)
    expected = reference.block_logits([t.draft_slot for t in rows_ref], block, BLOCK - 1)
    assert logits.shape == (2, BLOCK - 1, draft_vocab or target.model.config.vocab_size)
    assert torch.allclose(logits, expected, atol=1e-4)
    short = block[:, :3].contiguous()  # a block of 3 (what a drafter trained on short blocks runs at k = 2)
    logits = compiled.block_logits([t.draft_slot for t in rows], short, 2)
    assert torch.allclose(logits, reference.block_logits([t.draft_slot for t in rows_ref], short, 2), atol=1e-4)
    assert not torch.allclose(logits, expected[:, :2], atol=1e-4)  # the block's later positions are seen
    if window:  # the window changes what the longer row's block computes
        assert len(prompts[0]) - 1 + BLOCK > window
        other, other_rows = drafters[2]
        unseen = other.block_logits([t.draft_slot for t in other_rows], block, BLOCK - 1)
        assert not torch.allclose(unseen[0], expected[0], atol=1e-3)


def test_a_windowed_drafter_makes_no_context_its_window_never_reaches_and_drafts_the_same(pair, tmp_path):
    """Admitting a prompt longer than the window makes only the entries a later block can see
    (on the kernels and on PyTorch operators alike), and the block drafts what it would from all
    of them: the same bits on the kernels."""
    from tests.conftest import tiny_pair

    target, _ = pair
    plain, _ = tiny_pair(tmp_path, native_forward=False)  # the same weights (seeded), on PyTorch operators
    model = dflash_for(target.model, window=7)
    prompt = PROMPTS[2] + PROMPTS[0]  # 18 tokens: 17 held at admission, the last 6 of them made
    for served in (target, plain):
        logits, made = [], []
        for skip in (True, False):
            drafter = DFlashDrafter(model, served.model, 1, MAX_SEQ_LEN)
            drafter.skip_before_window = skip
            cache = served.model.new_cache(1, MAX_SEQ_LEN)
            slot = cache.allocate()
            taps = served.model(served.model.batch(cache, [slot], [prompt]), cache, capture=drafter.capture_layers)
            seq = Sequence(Request(tuple(prompt)), slot=slot, generator=None, tokens=list(prompt))
            before = drafter.cache.v.clone()  # [layers, slots, positions, kv heads, head dim]
            drafter.admit([seq], taps.hidden)
            made.append(int(drafter.cache.v[0].ne(before[0]).flatten(2).any(-1).sum()))
            block = torch.full((1, BLOCK), model.config.mask_token_id)
            block[0, 0] = prompt[-1]
            logits.append(drafter.block_logits([seq.draft_slot], block, BLOCK - 1))
            assert drafter.cache.lengths[seq.draft_slot] == len(prompt) - 1
        assert made == [len(prompt) - 1 - (len(prompt) - 1 + 2 - 7), len(prompt) - 1]
        if served.model.native is not None:
            assert torch.equal(logits[0], logits[1])
        else:  # the operators' products round by their shapes: 6 rows of context against 17
            torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_tapped_hidden_states_are_the_layer_outputs_of_the_full_forward(pair):
    """A tap is the output of its layer: what transformers calls hidden_states[i + 1]."""
    import transformers

    target, _ = pair
    reference = transformers.AutoModelForCausalLM.from_pretrained(target.path).eval()
    tokens = PROMPTS[2]
    with torch.no_grad():
        states = reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    cache = target.model.new_cache(1, MAX_SEQ_LEN)
    slot = cache.allocate()
    hidden = target.model(target.model.batch(cache, [slot], [tokens]), cache, capture=(0, 1)).hidden
    assert torch.allclose(hidden[0][0, : len(tokens)], states[1][0], atol=1e-4)


@pytest.mark.parametrize(
    "verification, draft_vocab, floor", [("block", 0, 0.0), ("token", 0, 0.0), ("block", 5, 0.0), ("block", 0, 0.1)]
)
def test_sampling_keeps_the_target_distribution(tiny_vocab_pair, verification, draft_vocab, floor):
    target, _ = tiny_vocab_pair
    prompt = tuple(range(8)) * 2
    base = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True)
    with torch.inference_mode():
        marginals = exact_marginals(target, prompt, base, 3)
    model = dflash_for(target.model, block_size=4, draft_vocab=draft_vocab)
    drafter = DFlashDrafter(model, target.model, 16, 32)
    engine = Engine(target, drafter, 16, 32, [2], verification=verification)
    requests = [
        Request(prompt, SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True))
        for s in range(1500)
    ]
    # A trimmed round stays exact: its length is chosen before the target looks.
    outputs = engine.run_until_done(requests, 2, ConfidenceRule(floor))
    assert engine.states[2].stats.drafts_proposed > 0
    if floor:
        drafted = engine.states[2].stats.proposed_at
        assert 0 < drafted[1] < 0.9 * drafted[0], "the floor trims some rounds' second draft, not all"
    assert_follows_marginals(outputs, requests, marginals)
