"""Prompts prefilled through piecewise graphs (engine/device/prefill.py), on the CPU stand-in for a
graph backend (tests/test_graphs.py's, which replays by re-running the captured function on the
same static buffers): the bucket ladder, every guard, the pieces against the eager forward, and the
whole engine lossless through them with every drafter. The same on a real GPU where one is present."""

from __future__ import annotations

import pytest
import torch

from daemon.metrics import Metrics
from engine.core import Engine, StepResult
from engine.device.backend import CpuBackend, CudaBackend, NpuBackend
from engine.device.graphs import ForwardMode, select_graph
from engine.device.prefill import PrefillGraphs, token_buckets
from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.model.transformer import ForwardBatch
from engine.request import Request
from engine.sampling import SamplingParams
from tests.test_backend import code_requests
from tests.test_graphs import MAX_SEQ_LEN, FakeGraphBackend, feature_drafter, load_tiny, reference
from tests.test_speculative import PROMPTS


class FakePrefillBackend(FakeGraphBackend):
    prefill_graphs_off = None


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tests.conftest import tiny_pair

    return tiny_pair(tmp_path_factory.mktemp("pair"), native_forward=False)


def test_the_ladder_ends_at_the_largest_and_pads_at_most_a_third():
    assert token_buckets(64) == [16, 24, 32, 48, 64]
    assert token_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(16) == [16] and token_buckets(10) == [10]
    buckets = token_buckets(2048)
    assert buckets[-1] == 2048 and buckets == sorted(set(buckets))
    for tokens in range(1, 2049):
        bucket = min(b for b in buckets if b >= tokens)
        assert tokens <= 16 or bucket - tokens < bucket / 3, tokens  # padding: under a third of a bucket


def test_only_a_graph_backend_that_allows_them_prefills_through_graphs(pair):
    target, _ = pair
    for backend_class in (CpuBackend, NpuBackend):
        assert backend_class.prefill_graphs_off  # each says why, in a line
    assert CudaBackend.prefill_graphs_off is None
    assert Engine(target, None, 2, MAX_SEQ_LEN, [0], backend=FakeGraphBackend()).prefill_graphs is None
    assert Engine(target, None, 2, MAX_SEQ_LEN, [0], backend=FakePrefillBackend()).prefill_graphs is not None
    off = Engine(target, None, 2, MAX_SEQ_LEN, [0], backend=FakePrefillBackend(), prefill_graph_tokens=0)
    assert off.prefill_graphs is None
    with pytest.raises(ValueError, match="no prefill graphs: no graphs on this device"):
        PrefillGraphs(target.model, target.model.new_cache(2, MAX_SEQ_LEN), FakeGraphBackend(), 64, 2)


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize(("family", "overrides"), [("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 6})])
@pytest.mark.parametrize("capture", [(), (0, 1)])
def test_the_pieces_give_the_eager_forwards_logits_cache_and_taps(family, overrides, capture):
    """Several mixes of prompt lengths, each prefilled twice into the same slots (the second time
    after what the first left in the buffers): logits, the cache's keys and values, and the taps
    equal the eager forward's, on a cache that already holds a sequence in another slot."""
    model = load_tiny(family, **overrides)
    vocab = model.config.vocab_size
    graphs_cache, eager_cache = model.new_cache(4, 32), model.new_cache(4, 32)
    graphs = PrefillGraphs(model, graphs_cache, FakePrefillBackend(), 64, 4, capture)
    assert graphs.buckets == [16, 24, 32, 48, 64]
    assert graphs.captures == 5 * (len(model.layers) + 1)
    with torch.inference_mode():
        for cache in (graphs_cache, eager_cache):  # a live sequence the prefills must leave alone
            cache.allocate()
            model(ForwardBatch.build(cache, [0], [[3, 4, 5]]), cache)
        for lengths in ([5], [1, 17], [9, 2, 30], [7, 7, 7], [31, 31]):
            slots = [1 + i for i in range(len(lengths))]
            for cache in (graphs_cache, eager_cache):
                for slot in slots:
                    cache.lengths[slot] = 0
            prompts = prompts_of(lengths, vocab, seed=len(lengths))
            out = graphs.run(slots, prompts, capture)
            assert out is not None
            eager = model(model.batch(eager_cache, slots, prompts), eager_cache, True, capture)
            torch.testing.assert_close(out.logits, eager.logits, atol=1e-5, rtol=1e-5)
            assert graphs_cache.lengths == eager_cache.lengths
            torch.testing.assert_close(graphs_cache.k, eager_cache.k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(graphs_cache.v, eager_cache.v, atol=1e-5, rtol=1e-5)
            assert sorted(out.hidden) == sorted(capture)
            for layer in capture:
                torch.testing.assert_close(out.hidden[layer], eager.hidden[layer], atol=1e-5, rtol=1e-5)
    assert graphs.replays == 5 and not graphs.fallbacks


def test_every_guard_sends_a_prefill_eagerly_with_its_reason_and_touches_nothing():
    model = load_tiny("llama")
    cache = model.new_cache(2, 32)
    slots = [cache.allocate(), cache.allocate()]
    backend = FakePrefillBackend()
    graphs = PrefillGraphs(model, cache, backend, 24, 2, (1,))
    replays = sum(g.replays for g in backend.graphs)
    cache.lengths[slots[1]] = 20
    refused = {
        "capture": (slots[:1], [[1, 2, 3]], ()),  # the graphs return layer 1's output, not none
        "rows": ([0, 1, 1], [[1], [2], [3]], (1,)),  # more prompts than captured rows
        "tokens": (slots, [[1] * 12, [2] * 13], (1,)),  # more than the largest bucket (24)
        "overflow": (slots[1:], [[1] * 13], (1,)),  # 20 + 13 > max_seq_len 32: the eager forward raises
    }
    for reason, (rows, prompts, capture) in refused.items():
        assert graphs.refusal(rows, prompts, capture) == reason
        assert graphs.run(rows, prompts, capture) is None
    assert graphs.fallbacks == dict.fromkeys(refused, 1)
    assert graphs.replays == 0 and cache.lengths == [0, 20]
    assert sum(g.replays for g in backend.graphs) == replays
    # Keyed PREFILL: never selected for a verify or a draft step, whatever fits.
    for mode in (ForwardMode.VERIFY, ForwardMode.DRAFT):
        assert select_graph(graphs.keys, mode, 1, 1, (1,)) is None


@pytest.mark.parametrize("kind", ["none", "draft_model", "ngram", "eagle3", "hybrid_eagle3", "dflash", "hybrid_dflash"])
def test_greedy_through_prefill_graphs_equals_target_only_with_every_drafter(pair, kind):
    """Prompts admitted together and one at a time, k changing every round: the output is
    target-only decoding's token for token, every prompt's tokens went through the graphs (with
    the taps a feature drafter reads), and the draft model's own prefill was not captured."""
    target, draft = pair
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = reference(target, PROMPTS, params)
    if kind == "none":
        drafter, ks = None, [0]
    elif kind == "draft_model":
        drafter, ks = DraftModelDrafter(draft, 4, MAX_SEQ_LEN), [0, 1, 3]
    elif kind == "ngram":
        drafter, ks = NgramDrafter(1, 3), [0, 1, 3]
    else:
        drafter, ks = feature_drafter(kind, target.model, 4), [0, 1, 3]
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, ks, backend=FakePrefillBackend(), prefill_graph_tokens=96)
    assert engine.prefill_graphs is not None and engine.prefill_graphs.capture == engine.capture_layers
    assert (kind in ("none", "draft_model", "ngram")) == (engine.capture_layers == ())
    requests = [Request(tuple(p), params) for p in PROMPTS]
    outputs = {r.id: [] for r in requests}
    engine.add_request(requests[0])
    steps, rounds, prefilled, admissions = 0, 0, 0, 0
    while engine.has_work or steps == 0:
        if steps == 2:  # the others join together, a few rounds later
            for request in requests[1:]:
                engine.add_request(request)
        result = engine.step(ks[steps % len(ks)])
        steps += 1
        rounds += result.batch_size > 0
        admissions += result.prefill_tokens > 0
        if result.prefill_tokens:
            assert result.prefill_graphed and result.prefill_fallback is None
            prefilled += result.prefill_tokens
        for out in result.outputs:
            outputs[out.request_id].extend(out.new_tokens)
    assert [outputs[r.id] for r in requests] == expected
    assert prefilled == sum(len(p) for p in PROMPTS)
    assert engine.prefill_graphs.replays == admissions == 2 and not engine.prefill_graphs.fallbacks
    if engine.graph_runner is not None and kind != "none":
        assert engine.graph_runner.replays == rounds  # every verify through its state's own graphs
    if kind == "draft_model":
        runner = drafter.graph_runner
        assert all(key.mode is not ForwardMode.PREFILL for key in drafter.graphs.graphs)
        assert runner.captures == len(drafter.graphs.graphs)


def test_a_prefill_beyond_the_largest_bucket_runs_eagerly_and_is_counted(pair):
    target, draft = pair
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    drafter = DraftModelDrafter(draft, 4, MAX_SEQ_LEN)
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, [3], backend=FakePrefillBackend(), prefill_graph_tokens=16)
    long_prompt = (PROMPTS[0] * 4)[:20]
    requests = [Request(tuple(long_prompt), params), Request(tuple(long_prompt[3:8]), params)]
    engine.add_request(requests[0])
    first = engine.step(3)
    assert first.prefill_tokens == 20 and not first.prefill_graphed and first.prefill_fallback == "tokens"
    engine.add_request(requests[1])
    second = engine.step(3)
    assert second.prefill_tokens == 5 and second.prefill_graphed and second.prefill_fallback is None
    while engine.has_work:
        engine.step(3)
    assert engine.prefill_graphs.fallbacks == {"tokens": 1} and engine.prefill_graphs.replays == 1

    metrics = Metrics(max_k=3)
    for result in (first, second):
        metrics.observe_step(result)
    exposition = metrics.exposition().decode()
    assert 'adaspec_prefill_tokens_total{path="eager"} 20.0' in exposition
    assert 'adaspec_prefill_tokens_total{path="graph"} 5.0' in exposition
    assert 'adaspec_prefill_fallbacks_total{reason="tokens"} 1.0' in exposition


def test_a_cpu_engine_counts_its_prefills_as_eager_with_no_fallback_reason(pair):
    target, _ = pair
    engine = Engine(target, None, 2, MAX_SEQ_LEN, [0])
    engine.add_request(Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=2, ignore_eos=True)))
    result: StepResult = engine.step(0)
    assert engine.prefill_graphs is None
    assert result.prefill_tokens == len(PROMPTS[0]) and not result.prefill_graphed
    assert result.prefill_fallback is None


# ---- on a GPU --------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("capture", [(), (0, 1)])
def test_on_cuda_replayed_prefill_equals_eager_at_several_lengths_and_mixes(capture):
    model = load_tiny("llama").to("cuda")
    model.build_rope()
    graphs_cache, eager_cache = model.new_cache(4, 128), model.new_cache(4, 128)
    graphs = PrefillGraphs(model, graphs_cache, CudaBackend(torch.device("cuda")), 128, 4, capture)
    with torch.inference_mode():
        for lengths in ([5], [1, 17], [9, 2, 30, 44], [100], [61, 3]):
            slots = list(range(len(lengths)))
            for cache in (graphs_cache, eager_cache):
                cache.lengths[:] = [0] * 4
            prompts = prompts_of(lengths, model.config.vocab_size, seed=sum(lengths))
            out = graphs.run(slots, prompts, capture)
            eager = model(model.batch(eager_cache, slots, prompts), eager_cache, True, capture)
            assert out is not None
            torch.testing.assert_close(out.logits, eager.logits, atol=1e-4, rtol=1e-4)
            for layer in capture:
                torch.testing.assert_close(out.hidden[layer], eager.hidden[layer], atol=1e-4, rtol=1e-4)
    assert graphs.replays == 5 and not graphs.fallbacks


@cuda
@pytest.mark.parametrize("kind", ["draft_model", "eagle3", "dflash"])
def test_on_cuda_greedy_through_prefill_graphs_equals_eager_prefill(kind):
    """The default models, code prompts of their own lengths joining one at a time: the same
    output with prompts through prefill graphs as prefilled eagerly, every drafter."""
    from engine.checkpoint import load_checkpoint
    from engine.drafters.dflash import DFlashDrafter
    from engine.drafters.eagle3 import Eagle3Drafter
    from engine.model.dflash import load_dflash
    from engine.model.eagle3 import load_eagle3
    from tests.conftest import DEFAULT_DRAFT, DEFAULT_TARGET

    target = load_checkpoint(DEFAULT_TARGET, "cuda", "float32")
    draft = load_checkpoint(DEFAULT_DRAFT, "cuda", "float32")
    models = DEFAULT_TARGET.parent
    served = []
    for tokens in (0, 2048):
        if kind == "draft_model":
            drafter = DraftModelDrafter(draft, 4, 512)
        elif kind == "eagle3":
            drafter = Eagle3Drafter(load_eagle3(models / "eagle3", target.model), target.model, 4, 512)
        else:
            drafter = DFlashDrafter(load_dflash(models / "dflash", target.model), target.model, 4, 512)
        engine = Engine(target, drafter, 4, 512, [0, 3], prefill_graph_tokens=tokens)
        assert (engine.prefill_graphs is not None) == (tokens > 0)
        requests = code_requests(target, 6, 64)
        outputs = {r.id: [] for r in requests}
        for request in requests:  # one joins each round: prefills of one prompt and of several
            engine.add_request(request)
            for out in engine.step(3).outputs:
                outputs[out.request_id].extend(out.new_tokens)
        while engine.has_work:
            for out in engine.step(3).outputs:
                outputs[out.request_id].extend(out.new_tokens)
        served.append([outputs[r.id] for r in requests])
        if tokens:
            assert engine.prefill_graphs.replays > 0 and not engine.prefill_graphs.fallbacks
    assert served[0] == served[1]


def test_the_pieces_read_nothing_back_to_the_host():
    """On the meta device any .tolist(), .item() or host copy fails: capturing every piece of every
    bucket there (the stand-in runs each body once) shows none has one, so no capture can hit a
    device synchronisation."""
    model = load_tiny("qwen3")
    cache = model.new_cache(2, 32)
    model.to("meta")
    cache.k, cache.v = cache.k.to("meta"), cache.v.to("meta")
    with torch.inference_mode():
        graphs = PrefillGraphs(model, cache, FakePrefillBackend(), 48, 2, (0, 1))
    assert graphs.captures == 4 * (len(model.layers) + 1)
    assert graphs.buffers.logits.device.type == "meta"
