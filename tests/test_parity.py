"""adaspec's runtime against transformers, the reference implementation, on every family."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint, to_hf_state_dict
from engine.generate import generate
from engine.model.kv_cache import KVCache
from engine.model.transformer import PACK_MIN_PADDING, ForwardBatch
from engine.sampling import SamplingParams
from tests.conftest import save_tiny, tiny_hf_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

FAMILIES = {
    "llama": dict(family="llama"),
    "llama3-rope-tied": dict(family="llama", rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-bias": dict(family="llama", attention_bias=True, mlp_bias=True),
    "mistral": dict(family="mistral", sliding_window=24),
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3"),
}


# Quantized in groups (engine.weights): the compiled forward streams int8 or uint4 groups, and
# transformers runs the float32 values they stand for (a tied lm head quantized with the rest).
QUANTIZED = [("llama3-rope-tied", "compiled-int8"), ("qwen3", "compiled-int4")]


@pytest.fixture(
    scope="module", params=[(f, path) for f in FAMILIES for path in ("compiled", "pytorch")] + QUANTIZED, ids="-".join
)
def pair(request, tmp_path_factory):
    """transformers' model and ours, on the compiled CPU forward (engine/native/) or PyTorch's."""
    name, forward = request.param
    forward, _, weights = forward.partition("-")
    settings = dict(FAMILIES[name])
    family = settings.pop("family")
    reference = tiny_hf_model(family, **settings)
    path = save_tiny(reference, tmp_path_factory.mktemp(name))
    checkpoint = load_checkpoint(path, native_forward=forward == "compiled", weights=weights or "as_loaded")
    if forward == "compiled" and checkpoint.model.native is None:
        pytest.skip("no compiled CPU kernels here")
    if weights:
        missing, unexpected = reference.load_state_dict(to_hf_state_dict(checkpoint.model), strict=False)
        assert not unexpected and missing in ([], ["lm_head.weight"])  # tied: the embedding's
    return reference, checkpoint


def test_prefill_and_cached_decode_match_transformers(pair):
    reference, checkpoint = pair
    torch.manual_seed(1)
    ids = torch.randint(2, reference.config.vocab_size, (1, 48))
    with torch.no_grad():
        expected = reference(ids).logits[0]

    model = checkpoint.model
    cache = model.new_cache(max_batch_size=2, max_seq_len=64)
    slot = cache.allocate()
    prefill = model(ForwardBatch.build(cache, [slot], [ids[0, :32].tolist()], model.config.sliding_window), cache)
    torch.testing.assert_close(prefill.logits[0], expected[:32], atol=1e-4, rtol=0)
    for position in range(32, 48):
        batch = ForwardBatch.build(cache, [slot], [[int(ids[0, position])]], model.config.sliding_window)
        logits = model(batch, cache).logits[0, 0]
        torch.testing.assert_close(logits, expected[position], atol=1e-4, rtol=0)
    assert cache.lengths[slot] == 48


def test_greedy_generation_matches_transformers_for_64_tokens(pair):
    reference, checkpoint = pair
    prompt = [5, 17, 33, 2, 9]
    reference.generation_config.eos_token_id = None  # decode all 64 tokens, as ignore_eos does
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, pad_token_id=0)
    expected = out[0, len(prompt) :].tolist()
    completion = generate(checkpoint, [prompt], SamplingParams(max_tokens=64, ignore_eos=True))[0]
    assert completion.tokens == expected


def test_ragged_batch_equals_each_sequence_alone(pair):
    _, checkpoint = pair
    prompts = [[3, 4, 5], [7] * 11, [8, 9, 10, 11, 12, 13, 14], [20, 21]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    together = generate(checkpoint, prompts, params)
    for prompt, completion in zip(prompts, together):
        alone = generate(checkpoint, [prompt], params)[0]
        assert completion.tokens == alone.tokens


@pytest.mark.parametrize(
    ("rows", "by_row"),
    [
        ([[3, 4, 5, 6, 7], [9], [11, 12, 13]], False),
        ([[3, 4, 5, 6, 7], [9], [11, 12, 13]], True),
        ([[3, 4, 5], [9, 10], [11, 12, 13]], False),
    ],
    ids=["packed", "by_row", "lightly_padded"],
)
def test_a_padded_forward_gives_each_sequence_what_it_alone_would(pair, rows, by_row):
    """Rows of different widths (a verify of ragged chains): the layers run on the real tokens
    alone (or, padded by fewer than PACK_MIN_PADDING tokens, on the padding too), attention runs
    padded or a row at a time, and each row's logits, last logits, hidden states and cache are as
    if it ran alone (past the sliding window where the family has one)."""
    _, checkpoint = pair
    model = checkpoint.model
    together_cache, alone_cache = model.new_cache(3, 48), model.new_cache(3, 48)
    slots = [together_cache.allocate() for _ in rows]
    assert [alone_cache.allocate() for _ in rows] == slots
    with torch.no_grad():
        for cache in (together_cache, alone_cache):
            for slot, prefix in zip(slots, ([1, 2] * 14, [1, 2, 8], [10] * 23)):
                model(ForwardBatch.build(cache, [slot], [prefix], model.config.sliding_window), cache)
        batch = ForwardBatch.build(together_cache, slots, rows, model.config.sliding_window, by_row=by_row)
        padding = len(rows) * max(map(len, rows)) - sum(map(len, rows))
        assert (batch.real is not None) == (by_row or padding >= PACK_MIN_PADDING)
        assert (batch.rows is not None) == by_row
        together = model(batch, together_cache, capture=(0,))
        for row, (slot, tokens) in enumerate(zip(slots, rows)):
            alone_batch = ForwardBatch.build(alone_cache, [slot], [tokens], model.config.sliding_window)
            alone = model(alone_batch, alone_cache, capture=(0,))
            n = len(tokens)
            torch.testing.assert_close(together.logits[row, :n], alone.logits[0], atol=1e-4, rtol=0)
            torch.testing.assert_close(together.hidden[0][row, :n], alone.hidden[0][0], atol=1e-4, rtol=0)
        assert together_cache.lengths == alone_cache.lengths
        length = max(together_cache.lengths[s] for s in slots)
        torch.testing.assert_close(
            together_cache.k[:, slots, :length], alone_cache.k[:, slots, :length], atol=1e-5, rtol=0
        )
        for cache in (together_cache, alone_cache):
            for slot, tokens in zip(slots, rows):
                cache.truncate(slot, cache.lengths[slot] - len(tokens))
        last = model(
            ForwardBatch.build(together_cache, slots, rows, model.config.sliding_window, by_row=by_row),
            together_cache,
            last_only=True,
        )
        for row, tokens in enumerate(rows):
            torch.testing.assert_close(last.logits[row, 0], together.logits[row, len(tokens) - 1], atol=1e-4, rtol=0)


def test_rows_attend_one_at_a_time_where_padding_would_cost_more():
    """A long context with one long chain among short ones scores far fewer query-key pairs a row
    at a time; chains of equal width, or a short context, stay one padded attention."""
    cache = KVCache(1, 4, 512, 1, 8, torch.float32, "cpu")
    slots = [cache.allocate() for _ in range(4)]
    for slot in slots:
        cache.lengths[slot] = 300

    def layout(widths: list[int]) -> bool:
        return ForwardBatch.build(cache, slots, [[1] * w for w in widths]).rows is not None

    assert layout([13, 1, 1, 1]) and layout([13, 4, 4, 4])
    assert not layout([4, 4, 4, 4]) and not layout([5, 4, 4, 4])
    for slot in slots:
        cache.lengths[slot] = 2
    assert not layout([13, 1, 1, 1])


def test_hidden_states_of_chosen_layers_match_transformers(pair):
    reference, checkpoint = pair
    ids = torch.arange(2, 14)[None]
    with torch.no_grad():
        expected = reference(ids, output_hidden_states=True).hidden_states
    model = checkpoint.model
    cache = model.new_cache(1, 32)
    slot = cache.allocate()
    out = model(ForwardBatch.build(cache, [slot], [ids[0].tolist()], model.config.sliding_window), cache, capture=(0,))
    # transformers' hidden_states[i + 1] is the output of layer i (the last one after the final norm).
    torch.testing.assert_close(out.hidden[0][0], expected[1][0], atol=1e-4, rtol=0)
    assert set(out.hidden) == {0}
