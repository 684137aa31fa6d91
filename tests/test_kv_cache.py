"""The KV cache: rollback, slot reuse, capacity, slots in any order."""

from __future__ import annotations

import pytest
import torch

from engine.model.kv_cache import CacheFullError
from engine.model.transformer import ForwardBatch
from tests.conftest import forward_one


def test_rollback_then_continue_equals_never_having_drafted(tiny_llama):
    model = tiny_llama.model
    cache = model.new_cache(2, 64)
    clean, drafted = cache.allocate(), cache.allocate()
    forward_one(model, cache, clean, [3, 4, 5, 6])
    forward_one(model, cache, drafted, [3, 4, 5, 6])
    forward_one(model, cache, drafted, [40, 41, 42])  # a rejected draft
    cache.rollback(drafted, 3)
    assert cache.lengths[drafted] == 4
    after_clean = forward_one(model, cache, clean, [7, 8])
    after_rollback = forward_one(model, cache, drafted, [7, 8])
    torch.testing.assert_close(after_rollback, after_clean, atol=0, rtol=0)
    n = cache.lengths[clean]
    torch.testing.assert_close(cache.keys(drafted)[:, :n], cache.keys(clean)[:, :n], atol=0, rtol=0)


def test_slots_are_freed_and_reused(tiny_llama):
    cache = tiny_llama.model.new_cache(2, 16)
    a, b = cache.allocate(), cache.allocate()
    with pytest.raises(CacheFullError):
        cache.allocate()
    forward_one(tiny_llama.model, cache, a, [3, 4, 5])
    cache.release(a)
    again = cache.allocate()
    assert again == a and cache.lengths[again] == 0
    assert b != a


def test_sequence_longer_than_the_cache_is_refused(tiny_llama):
    cache = tiny_llama.model.new_cache(1, 8)
    slot = cache.allocate()
    with pytest.raises(ValueError, match="exceed max_seq_len 8"):
        ForwardBatch.build(cache, [slot], [list(range(9))])


def test_batch_on_non_contiguous_slots_matches_contiguous(tiny_llama):
    model = tiny_llama.model
    cache = model.new_cache(4, 32)
    slots = [cache.allocate() for _ in range(4)]
    prompts = [[3, 4, 5], [9, 10], [11, 12, 13, 14], [5]]
    out_all = model(ForwardBatch.build(cache, slots, prompts), cache, last_only=True).logits
    cache2 = model.new_cache(4, 32)
    slots2 = [cache2.allocate() for _ in range(4)]
    picked = [slots2[3], slots2[1]]
    out_some = model(ForwardBatch.build(cache2, picked, [prompts[0], prompts[2]]), cache2, last_only=True).logits
    torch.testing.assert_close(out_some[0], out_all[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out_some[1], out_all[2], atol=1e-5, rtol=0)
