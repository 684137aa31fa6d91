"""The DFlash block drafter: lossless at every k and under switching, its context cache in step with
the target, its checkpoint checked against the target."""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import replace

import pytest
import torch

from daemon.metrics import Metrics
from engine.config import CheckpointError
from engine.core import Engine
from engine.dflash import (
    DFlashConfig,
    DFlashDrafter,
    DFlashModel,
    HybridDFlashDrafter,
    default_taps,
    load_dflash,
    save_dflash,
)
from engine.drafters import Proposal
from engine.generate import generate
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
    initial: int | None = None,
    quantize: bool = False,
    window: int | None = None,
) -> Engine:
    model = dflash_for(target.model, window=window)
    drafter = DFlashDrafter(model, target.model, batch, MAX_SEQ_LEN, quantize=quantize)
    assert drafter.native is not None and (drafter.native.weights.linears == torch.int8) == quantize
    return Engine(target, drafter, batch, MAX_SEQ_LEN, ks, initial_k=initial)


def test_taps_spread_from_layer_1_to_l_minus_3():
    assert default_taps(8, 2) == (1, 5) and default_taps(8, 3) == (1, 3, 5)
    assert default_taps(36, 5) == (1, 9, 17, 25, 33)
    assert all(0 <= t < 2 for t in default_taps(2, 2))  # a tiny target: every tap inside it


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_target_only_for_every_k(pair, batch):
    target, _ = pair
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = PROMPTS[:batch]
    expected = [c.tokens for c in generate(target, prompts, params)]
    for k in (0, 1, 2, 3, 5):
        engine = engine_for(target, batch, (k,), k)
        requests = [Request(tuple(p), params) for p in prompts]
        outputs = engine.run_until_done(requests)
        assert [outputs[r.id] for r in requests] == expected, f"k={k}"
        if k:
            assert engine.state.stats.drafts_proposed > 0


def serve_switching(engine: Engine, params: SamplingParams, seed: int) -> list[list[int]]:
    """Every prompt's output, served together with k drawn at random at every boundary."""
    rng = random.Random(seed)
    requests = [Request(tuple(p), params) for p in PROMPTS]
    outputs: dict[str, list[int]] = {r.id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_work:
        engine.select(rng.choice([0, 1, 2, 3, 5]))
        for out in engine.step().outputs:
            outputs[out.request_id].extend(out.new_tokens)
    return [outputs[r.id] for r in requests]


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
    """With engine.draft_confidence, a round verifies a row's drafts while the product of the
    drafter's probabilities of them stays at or above the floor: unsure blocks verify fewer, the
    output is target-only's all the same."""
    target, _ = pair
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS, params)]
    engine = engine_for(target, 4, (5,), 5)
    seen: list[tuple[list[float], int]] = []  # each row's confidences and the drafts it verified
    propose = engine.drafter.propose

    def recording(seqs, ks, *rest):
        proposals = propose(seqs, ks, *rest)
        seen.extend((list(p.confidence), len(p.tokens)) for p in proposals if p.confidence)
        return proposals

    engine.drafter.propose = recording
    requests = [Request(tuple(p), params) for p in PROMPTS]
    engine.run_until_done(requests)  # no floor: every row verifies its 5 drafts
    assert seen and all(n == len(c) for c, n in seen) and max(n for _, n in seen) == 5
    chances = sorted(c[0] * c[1] for c, _ in seen if len(c) >= 2)
    floor = chances[len(chances) // 2]  # the median chance of the first two drafts

    engine = engine_for(target, 4, (5,), 5)
    engine.draft_confidence = floor
    trimmed = Proposal([1, 2, 3, 4, 5], confidence=[0.9, 0.5, 0.9, 0.1, 0.9])
    assert trimmed.confident_drafts(0.4) == 3 and trimmed.confident_drafts(0.5) == 1
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
        result = engine.step()
        metrics.observe_step(result)
        for out in result.outputs:
            outputs[out.request_id].extend(out.new_tokens)
    assert [outputs[r.id] for r in requests] == expected
    verified = engine.state.stats.proposed_at
    assert verified[0] > verified[1] > 0, "some rounds verify fewer drafts, others more"
    for proposal, confidence in drafted:
        n = len(proposal.tokens)
        chances = [math.prod(confidence[: j + 1]) for j in range(len(confidence))]
        assert all(c >= floor for c in chances[:n]) and all(c < floor for c in chances[n : n + 1])
    trimmed = sum(len(confidence) - len(proposal.tokens) for proposal, confidence in drafted)
    assert trimmed > 0 and f"adaspec_trimmed_drafts_total {trimmed}.0" in metrics.exposition().decode()


def test_the_floor_applies_while_the_policy_adapts_never_to_a_pinned_k(pair):
    from control.schema import policy_params
    from engine.controller import Controller, Pin, Unpin

    target, _ = pair
    params = policy_params(strategy="measured", candidate_k=(0, 2, 5), draft_confidence=0.5)
    controller = Controller(engine_for(target, 4, (0, 2, 5)), params)
    floors = []  # the floor each round ran with
    step = controller.step

    def recording():
        result = step()
        floors.append(controller.engine.draft_confidence)
        return result

    controller.step = recording
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
    assert engine.state.stats.drafts_proposed > 0
    # Both proposed: some rows' drafts were looked up, others drafted by the block drafter.
    assert any(p.tokens for found in lookups for p in found) and forwards


def test_the_context_cache_follows_the_target_and_rolls_back_exactly(pair):
    """After rounds of drafting and rejection, the drafter's context keys and values equal those
    built fresh from the target's own forward over the same tokens."""
    target, _ = pair
    engine = engine_for(target, 1, (3,), 3)
    request = Request(tuple(PROMPTS[2]), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request(request)
    for _ in range(4):
        engine.step()
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
    engine.draft_confidence = floor  # a trimmed round stays exact: its length is chosen before the target looks
    requests = [
        Request(prompt, SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True))
        for s in range(1500)
    ]
    outputs = engine.run_until_done(requests)
    assert engine.state.stats.drafts_proposed > 0
    if floor:
        drafted = engine.state.stats.proposed_at
        assert 0 < drafted[1] < 0.9 * drafted[0], "the floor trims some rounds' second draft, not all"
    assert_follows_marginals(outputs, requests, marginals)


def test_checkpoint_round_trip_and_every_mismatch_named(pair, tmp_path):
    target, _ = pair
    model = dflash_for(target.model)
    save_dflash(model, tmp_path / "dflash")
    raw = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert raw["block_size"] == BLOCK and raw["dflash_config"]["target_layer_ids"] == list(
        model.config.target_layer_ids
    )
    loaded = load_dflash(tmp_path / "dflash", target.model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name])

    def broken(name: str, edit) -> str:
        bad = tmp_path / name
        save_dflash(model, bad)
        edited = json.loads(json.dumps(raw))
        edit(edited)
        (bad / "config.json").write_text(json.dumps(edited))
        with pytest.raises(CheckpointError) as caught:
            load_dflash(bad, target.model)
        return str(caught.value)

    assert "hidden size 32" in broken("hidden", lambda c: c.update(hidden_size=32))
    assert "vocabulary of 10" in broken("vocab", lambda c: c.update(vocab_size=10))
    assert "taps [7] outside" in broken("taps", lambda c: c["dflash_config"].update(target_layer_ids=[0, 7]))
    assert "mask token id 999" in broken("mask", lambda c: c["dflash_config"].update(mask_token_id=999))
    assert "not a DFlash config (no 'dflash_config')" in broken("plain", lambda c: c.pop("dflash_config"))
    eagle3 = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    assert "an EAGLE-3 head's config" in broken("eagle3", lambda c: c.pop("dflash_config") and c.update(eagle3))
    assert "draft vocabulary of 100000" in broken("draft vocab", lambda c: c.update(draft_vocab_size=100000))
    assert "sliding_window must be a whole number of positions >= 1 or null, got -1" in broken(
        "window", lambda c: c.update(sliding_window=-1)
    )
    assert "sliding window 5, shorter than its block of 6" in broken("narrow", lambda c: c.update(sliding_window=5))
    assert "sliding_window" not in raw
    save_dflash(dflash_for(target.model, window=256), tmp_path / "windowed")
    assert load_dflash(tmp_path / "windowed", target.model).config.sliding_window == 256

    small = dflash_for(target.model, draft_vocab=30, short_blocks=True)
    save_dflash(small, tmp_path / "small")
    raw_small = json.loads((tmp_path / "small" / "config.json").read_text())
    assert raw_small["draft_vocab_size"] == 30 and raw_small["dflash_config"]["short_blocks"] is True
    loaded = load_dflash(tmp_path / "small", target.model)
    assert torch.equal(loaded.draft_to_target(), small.draft_to_target()) and loaded.config.short_blocks
    assert not load_dflash(tmp_path / "dflash", target.model).config.short_blocks
    small.d2t[-1] = target.model.config.vocab_size  # maps its last draft id past the vocabulary
    save_dflash(small, tmp_path / "bad map")
    with pytest.raises(CheckpointError, match="d2t maps draft ids outside the vocabulary"):
        load_dflash(tmp_path / "bad map", target.model)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_dflash(tmp_path / "nowhere", target.model)


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


@pytest.mark.parametrize("kind", ["dflash", "hybrid_dflash"])
def test_the_config_the_daemon_and_the_benches_take_the_dflash_drafter(pair, tmp_path, kind):
    from control.issues import ConfigError
    from control.load import load_config
    from daemon.runtime import build_controller, load_models
    from engine.controller import Controller

    target, _ = pair
    save_dflash(dflash_for(target.model), tmp_path / "dflash")
    config = tmp_path / "config.toml"
    config.write_text(
        f'[engine]\ntarget = "{target.path}"\ndrafter = "{kind}"\ndflash = "dflash"\nmax_seq_len = {MAX_SEQ_LEN}\n'
        "[adaptive]\ncandidate_k = [0, 2, 5]\n"
    )
    snapshot = load_config(config, check_models=True)
    controller: Controller = build_controller(snapshot, load_models(snapshot), max_batch_size=2)
    drafter = controller.engine.drafter
    assert isinstance(drafter, DFlashDrafter) and isinstance(drafter, HybridDFlashDrafter) == (kind == "hybrid_dflash")
    assert_serves_losslessly(controller, target)

    other = dflash_for(target.model)
    wrong = DFlashModel(DFlashConfig(**{**other.config.__dict__, "hidden_size": 32}))
    save_dflash(wrong, tmp_path / "wrong")
    config.write_text(config.read_text().replace('dflash = "dflash"', 'dflash = "wrong"'))
    with pytest.raises(ConfigError, match="engine.dflash: .*does not fit the target: hidden size 32"):
        load_config(config, check_models=True)


def test_the_training_script_runs_end_to_end_and_its_loss_falls(pair, tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    target, _ = pair
    rng = random.Random(0)
    words = [f"w{rng.randrange(2, 40)}" for _ in range(60)]
    (tmp_path / "data.txt").write_text(" ".join(words * 40))  # repetitive: learnable in a few steps
    out = tmp_path / "dflash"
    command = [sys.executable, "tools/train_dflash.py", str(target.path), str(out), "--steps", "60"]
    command += ["--block", "4", "--seq-len", "48", "--anchors", "8", "--batch", "4", "--lr", "3e-3"]
    command += ["--data", str(tmp_path / "data.txt"), "--prompts", "0"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "training_report.json").read_text())
    assert report["last_loss"] < 0.6 * report["first_loss"]  # KL from the target's distribution
    trained = load_dflash(out, target.model).config
    assert trained.block_size == 4 and trained.sliding_window == 48  # no further back than it trained on
    resumed = subprocess.run(command[:-2] + ["--prompts", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "resuming at step 60" in resumed.stderr


def test_a_drafter_deepened_by_the_training_script_starts_by_drafting_what_it_deepened(pair, tmp_path):
    """--init with a shallower drafter and more --layers: the added layer starts as the identity,
    so before any step the deeper drafter's logits are the shallower one's; --save-dtype bfloat16
    writes half the bytes, and the loader runs them in float32."""
    import subprocess
    import sys

    from safetensors import safe_open

    from tests.conftest import ROOT

    target, _ = pair
    (tmp_path / "data.txt").write_text(" ".join(f"w{i % 37}" for i in range(400)))
    command = [sys.executable, "tools/train_dflash.py", str(target.path), str(tmp_path / "shallow"), "--steps", "0"]
    command += ["--block", "4", "--seq-len", "48", "--data", str(tmp_path / "data.txt"), "--prompts", "0"]
    command += ["--work", str(tmp_path / "work"), "--save-dtype", "bfloat16"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)  # 2 layers, at random
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "deep"
    command[3] = str(out)
    command += ["--layers", "3", "--init", str(tmp_path / "shallow")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert weights.get_tensor("layers.2.q_proj.weight").dtype == torch.bfloat16
    deep, before = load_dflash(out, target.model), load_dflash(tmp_path / "shallow", target.model)
    assert deep.config.num_layers == 3 and deep.fc.weight.dtype == torch.float32
    outputs = []
    for model in (before, deep):
        drafter = DFlashDrafter(model, target.model, 1, MAX_SEQ_LEN)
        seq = Sequence(Request(tuple(PROMPTS[0])), slot=0, generator=None, tokens=list(PROMPTS[0]))
        cache = target.model.new_cache(1, MAX_SEQ_LEN)
        batch = target.model.batch(cache, [cache.allocate()], [PROMPTS[0][:-1]])
        drafter.admit([seq], target.model(batch, cache, capture=drafter.capture_layers).hidden)
        block = torch.full((1, 4), model.config.mask_token_id)
        block[0, 0] = seq.tokens[-1]
        outputs.append(drafter.block_logits([seq.draft_slot], block, 3))
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5)

    command[command.index("--init") + 1] = str(out)  # deeper than --layers: refused, by name
    command[command.index("--layers") + 1] = "2"
    command[3] = str(tmp_path / "again")
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "--init has weights this drafter lacks: ['layers.2." in refused.stderr


@pytest.mark.parametrize("draft_vocab, short_blocks", [(0, 0.0), (24, 0.5)])
def test_the_training_script_learns_the_targets_own_greedy_continuations(pair, tmp_path, draft_vocab, short_blocks):
    """With --regenerate the data is the target's own greedy output after training-text prompts
    (what a drafter meets when the target serves greedily), and the drafter learns it, over the
    whole vocabulary or over --draft-vocab's most frequent ids, on whole blocks or on shorter ones too."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    target, _ = pair
    rng = random.Random(1)
    (tmp_path / "data.txt").write_text(" ".join(f"w{rng.randrange(2, 40)}" for _ in range(400)))
    out, work = tmp_path / "dflash", tmp_path / "work"
    command = [sys.executable, "tools/train_dflash.py", str(target.path), str(out), "--steps", "60", "--block", "4"]
    command += ["--seq-len", "40", "--prompt-len", "16", "--regenerate", "12", "--anchors", "8", "--batch", "4"]
    command += ["--lr", "3e-3", "--data", str(tmp_path / "data.txt"), "--prompts", "0", "--work", str(work)]
    command += ["--draft-vocab", str(draft_vocab), "--short-blocks", str(short_blocks)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    sequences = torch.load(work / "greedy.pt")
    drafter = load_dflash(out, target.model)
    assert drafter.config.short_blocks == (short_blocks > 0)
    if draft_vocab:  # the most frequent ids of the sequences
        counts = torch.bincount(sequences.flatten(), minlength=target.model.config.vocab_size)
        assert drafter.config.draft_vocab_size == draft_vocab
        assert counts[drafter.draft_to_target()].min() >= counts.sort(descending=True).values[draft_vocab - 1]
    assert sequences.shape == (12, 40)
    prompts = sequences[:, :16].tolist()
    continuations = generate(target, prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [c.tokens for c in continuations] == sequences[:, 16:].tolist()
    report = json.loads((out / "training_report.json").read_text())
    assert report["regenerated_sequences"] == 12
    assert report["last_loss"] < 0.6 * report["first_loss"]  # cross-entropy on the target's greedy tokens


def bench_modes_naming(kind: str, target, folder):
    """The bench's static:2 mode over a config serving drafter `kind` from folder/"ours", and the
    same mode with `+KIND=folder/other`; a mode naming a folder with no drafter is refused by name.
    Both drafters must be saved there already."""
    from bench import spec
    from control.load import load_config
    from daemon.runtime import load_models

    config = folder / "config.toml"
    config.write_text(
        f'[engine]\ntarget = "{target.path}"\ndrafter = "{kind}"\n{kind} = "ours"\nmax_seq_len = {MAX_SEQ_LEN}\n'
    )
    snapshot = load_config(config, check_models=True)
    models = load_models(snapshot)
    ours = spec.build_controller("static:2", snapshot, models, 1, MAX_SEQ_LEN)
    theirs = spec.build_controller(f"static:2+{kind}={folder / 'other'}", snapshot, models, 1, MAX_SEQ_LEN)
    nowhere = f"static:2+{kind}={folder / 'nowhere'}"
    with pytest.raises(SystemExit, match=f"mode '{re.escape(nowhere)}': .*nowhere: no such directory"):
        spec.build_controller(nowhere, snapshot, models, 1, MAX_SEQ_LEN)
    with pytest.raises(SystemExit, match="mode 'static:99': draft length 99 is outside 0..32"):
        spec.build_controller("static:99", snapshot, models, 1, MAX_SEQ_LEN)
    return ours, theirs


def test_a_bench_mode_serves_the_dflash_drafter_it_names(pair, tmp_path):
    """`+dflash=PATH` in a bench mode: that drafter drafts in place of the config's, on the same
    loaded target, so two drafters are compared side by side; a path with none is named."""
    target, _ = pair
    save_dflash(dflash_for(target.model), tmp_path / "ours")
    save_dflash(dflash_for(target.model, seed=1, window=7), tmp_path / "other")
    ours, theirs = bench_modes_naming("dflash", target, tmp_path)
    assert ours.engine.drafter.config.sliding_window is None
    assert theirs.engine.drafter.config.sliding_window == 7
    assert_serves_losslessly(theirs, target)
