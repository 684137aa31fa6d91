"""Captured forwards on a CPU: the graph guards, the static-shape forward a graph captures, and
the whole engine running through a graph runner whose backend 'replays' by re-running the
captured function (same static buffers, same outputs overwritten in place)."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.confidence import EVERY_DRAFT
from engine.core import Engine
from engine.device.backend import Backend
from engine.device.graphs import (
    ForwardMode,
    GraphKey,
    GraphRunner,
    default_batch_sizes,
    pack_inputs,
    select_graph,
    static_forward,
)
from engine.drafters.base import Proposal
from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.generate import generate
from engine.model.transformer import ForwardBatch
from engine.request import Request
from engine.sampling import SamplingParams
from tests.conftest import DEFAULT_TARGET, save_tiny, tiny_hf_model, tiny_pair
from tests.test_speculative import PROMPTS

MAX_SEQ_LEN = 96
STEPS = (0, 1, 2, 3, 5, 7)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny pair on PyTorch operators: graphs capture those, never the compiled CPU forward."""
    return tiny_pair(tmp_path_factory.mktemp("pair"), native_forward=False)


class RerunGraph:
    """Stands in for a captured graph: replay re-runs the body and overwrites the captured outputs."""

    def __init__(self, fn, outputs) -> None:
        self.fn = fn
        self.outputs = outputs
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for out, new in zip(self.outputs, self.fn()):
            out.copy_(new)


class FakeGraphBackend(Backend):
    name = "fake"
    supports_graphs = True

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.graphs: list[RerunGraph] = []

    def capture(self, fn):
        outputs = fn()
        graph = RerunGraph(fn, outputs)
        self.graphs.append(graph)
        return graph, outputs


def test_engine_on_cpu_captures_nothing(pair):
    target, draft = pair
    engine = Engine(target, DraftModelDrafter(draft, 2, MAX_SEQ_LEN), 2, MAX_SEQ_LEN, [0, 3])
    assert engine.backend.name == "cpu" and engine.graph_runner is None and engine.drafter.graph_runner is None
    assert engine.graph_captures == 0
    assert all(s.graphs is None and s.memory_bytes == 0 for s in engine.states.values())
    assert engine.drafter.graphs is None


# ---- guards ------------------------------------------------------------------------------


def test_default_batch_sizes():
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(8) == [1, 2, 4, 8]
    assert default_batch_sizes(6) == [1, 2, 4, 6]


def test_selection_matches_mode_and_capture_and_pads_width_and_batch():
    keys = [GraphKey(ForwardMode.VERIFY, 4, b) for b in (1, 2, 4)]
    keys += [GraphKey(ForwardMode.VERIFY, 4, b, (1,)) for b in (1, 2, 4)]
    keys += [GraphKey(ForwardMode.DRAFT, w, b) for w in (1, 2) for b in (1, 2, 4)]
    keys += [GraphKey(ForwardMode.PREFILL, 16, 4)]
    verify, draft, prefill = ForwardMode.VERIFY, ForwardMode.DRAFT, ForwardMode.PREFILL

    assert select_graph(keys, verify, 4, 3) == GraphKey(verify, 4, 4)
    assert select_graph(keys, verify, 4, 1, (1,)) == GraphKey(verify, 4, 1, (1,))
    # A verify of one token (k = 0, or drafts cut short) pads to the verify width: never a draft
    # step or a prefill graph, though both would fit.
    assert select_graph(keys, verify, 1, 1) == GraphKey(verify, 4, 1)
    assert select_graph(keys, draft, 1, 2) == GraphKey(draft, 1, 2)
    assert select_graph(keys, draft, 2, 3) == GraphKey(draft, 2, 4)
    assert select_graph(keys, prefill, 9, 2) == GraphKey(prefill, 16, 4)
    # Eager: too many rows, too wide, hidden states not captured, nothing for the mode.
    assert select_graph(keys, verify, 4, 5) is None
    assert select_graph(keys, verify, 5, 1) is None
    assert select_graph(keys, draft, 3, 1) is None
    assert select_graph(keys, verify, 4, 1, (0,)) is None
    assert select_graph(keys, verify, 4, 1, (0, 1)) is None
    assert select_graph([k for k in keys if k.mode is not prefill], prefill, 1, 1) is None


def test_runner_refuses_to_capture_prefill(pair):
    target, _ = pair
    runner = GraphRunner(target.model, target.model.new_cache(2, MAX_SEQ_LEN), FakeGraphBackend(), [1, 2])
    with pytest.raises(ValueError, match="captured piecewise"):
        runner.capture(ForwardMode.PREFILL, [8])
    assert runner.captures == 0


@torch.inference_mode()
def test_runner_replays_only_what_fits_and_falls_back_otherwise(pair):
    target, _ = pair
    model = target.model
    cache = model.new_cache(4, MAX_SEQ_LEN)
    slots = [cache.allocate() for _ in range(4)]
    model(ForwardBatch.build(cache, slots, PROMPTS), cache)
    backend = FakeGraphBackend()
    runner = GraphRunner(model, cache, backend, [1, 2])
    graphs = runner.capture(ForwardMode.VERIFY, [3])
    assert sorted((k.width, k.batch_size) for k in graphs.graphs) == [(3, 1), (3, 2)] and runner.captures == 2
    lengths = list(cache.lengths)

    eager_cases = [
        (ForwardMode.VERIFY, slots[:3], [[5, 6, 7]] * 3, ()),  # more rows than the largest bucket
        (ForwardMode.VERIFY, slots[:1], [[5, 6, 7, 8]], ()),  # wider than k + 1
        (ForwardMode.VERIFY, slots[:1], [[5, 6]], (0,)),  # hidden states the graph does not return
        (ForwardMode.DRAFT, slots[:1], [[5]], ()),  # another mode
        (ForwardMode.PREFILL, slots[:1], [[5, 6]], ()),
        (ForwardMode.VERIFY, slots[:1], [[]], ()),  # invalid: the eager path raises the error
    ]
    for mode, rows, tokens, capture in eager_cases:
        assert graphs.run(mode, rows, tokens, capture) is None
    assert runner.eager_runs == len(eager_cases) and runner.replays == 0
    assert sum(g.replays for g in backend.graphs) == 0 and cache.lengths == lengths

    out = graphs.run(ForwardMode.VERIFY, [slots[2]], [[5, 6]])
    assert out is not None and out.logits.shape == (1, 3, model.config.vocab_size)
    assert runner.replays == 1 and cache.lengths[slots[2]] == lengths[slots[2]] + 2
    assert runner.captures == 2  # replaying never captures


def test_static_forward_equals_the_eager_ragged_forward():
    """The graph body, run on CPU, gives the eager forward's logits and cache contents: padded
    width, padded rows, non-contiguous slots, and a sliding window all included."""
    model = load_tiny("mistral", sliding_window=6)
    cache = model.new_cache(4, 32)
    slots = [cache.allocate() for _ in range(4)]
    with torch.inference_mode():
        model(ForwardBatch.build(cache, slots, [[3, 4, 5, 6, 7, 8, 9], [9, 10], [11, 12, 13, 14], [5]]), cache)
        picked = [slots[3], slots[0], slots[2]]
        new = [[20, 21, 22], [23], [24, 25]]
        eager_cache, static_cache = clone_cache(cache), clone_cache(cache)
        eager = model(ForwardBatch.build(eager_cache, picked, new, model.config.sliding_window), eager_cache)
        width, rows = 4, 4  # one more column and one more row than the batch needs
        inputs = pack_inputs(static_cache, picked, new, width, rows)
        logits, *_ = static_forward(model, static_cache, inputs, width, (), last_only=False)
        last, *_ = static_forward(model, clone_cache(cache), inputs, width, (), last_only=True)
    for row, tokens in enumerate(new):
        n = len(tokens)
        torch.testing.assert_close(logits[row, :n], eager.logits[row, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(last[row, 0], eager.logits[row, n - 1], atol=1e-5, rtol=0)
    for slot, tokens in zip(picked, new):
        end = eager_cache.lengths[slot]  # the eager forward advanced it; the static one did not
        assert end == cache.lengths[slot] + len(tokens) and static_cache.lengths[slot] == cache.lengths[slot]
        torch.testing.assert_close(static_cache.k[:, slot, :end], eager_cache.k[:, slot, :end], atol=1e-6, rtol=0)
        torch.testing.assert_close(static_cache.v[:, slot, :end], eager_cache.v[:, slot, :end], atol=1e-6, rtol=0)
    assert torch.isfinite(static_cache.k).all() and torch.isfinite(static_cache.v).all()


def test_the_captured_body_reads_nothing_back_to_the_host():
    """On the meta device any .tolist(), .item() or host copy fails: the graph body has none, so
    a capture cannot hit a device synchronisation (the eager forward does read back)."""
    model = load_tiny("mistral", sliding_window=6)
    cache = model.new_cache(2, 16)
    model.to("meta")
    cache.k, cache.v = cache.k.to("meta"), cache.v.to("meta")
    inputs = torch.zeros(2, 4 + 3, dtype=torch.long, device="meta")
    with torch.inference_mode():
        logits, hidden = static_forward(model, cache, inputs, 4, (0,), last_only=False)
        last, _ = static_forward(model, cache, inputs, 4, (0,), last_only=True)
    assert logits.shape == (2, 4, 64) and hidden.shape == (2, 4, 64) and last.shape == (2, 1, 64)
    batch = ForwardBatch(inputs[:, :4], inputs[:, :4], inputs[:, :4], inputs[:, 6], None, [1, 1], 17, None)
    with pytest.raises(NotImplementedError), torch.inference_mode():
        model(batch, cache)


def load_tiny(family: str, **overrides):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        return load_checkpoint(
            save_tiny(tiny_hf_model(family, vocab_size=64, **overrides), Path(tmp)), native_forward=False
        ).model


def clone_cache(cache):
    copy = type(cache).__new__(type(cache))
    copy.__dict__.update(cache.__dict__)
    copy.k, copy.v = cache.k.clone(), cache.v.clone()
    copy.lengths, copy._free = list(cache.lengths), list(cache._free)
    return copy


# ---- the engine through graphs (CPU stand-in) ------------------------------------------------


def reference(target, prompts, params):
    return [c.tokens for c in generate(target, prompts, params)]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_through_graphs_equals_target_only_for_every_k(pair, batch_size):
    target, draft = pair
    prompts = PROMPTS[:batch_size]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = reference(target, prompts, params)
    for k in STEPS:
        drafter = DraftModelDrafter(draft, batch_size, MAX_SEQ_LEN)
        engine = Engine(target, drafter, batch_size, MAX_SEQ_LEN, STEPS, backend=FakeGraphBackend())
        requests = [Request(tuple(p), params) for p in prompts]
        outputs = engine.run_until_done(requests, k)
        assert [outputs[r.id] for r in requests] == expected, f"k={k}"
        stats = engine.states[k].stats
        assert engine.graph_runner.replays == stats.rounds and engine.graph_runner.eager_runs == 0
        if k:
            assert drafter.graph_runner.replays > 0 and stats.drafts_proposed > 0


def test_states_own_their_graphs_and_switching_captures_nothing(pair):
    target, draft = pair
    drafter = DraftModelDrafter(draft, 4, MAX_SEQ_LEN)
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, STEPS, backend=FakeGraphBackend())
    buckets = default_batch_sizes(4)
    for k, state in engine.states.items():
        keys = set(state.graphs.graphs)
        assert keys == {GraphKey(ForwardMode.VERIFY, k + 1, b) for b in buckets}
    assert set(drafter.graphs.graphs) == {GraphKey(ForwardMode.DRAFT, w, b) for w in (1, 2) for b in buckets}
    captured = engine.graph_captures
    assert captured == len(STEPS) * len(buckets) + 2 * len(buckets)

    params = SamplingParams(max_tokens=48, ignore_eos=True)
    expected = reference(target, PROMPTS, params)
    requests = [Request(tuple(p), params) for p in PROMPTS]
    for request in requests:
        engine.add_request(request)
    outputs = {r.id: [] for r in requests}
    ks = iter(STEPS * 20)
    while engine.has_work:
        for out in engine.step(next(ks)).outputs:
            outputs[out.request_id].extend(out.new_tokens)
    assert [outputs[r.id] for r in requests] == expected
    assert engine.graph_captures == captured
    assert engine.graph_runner.replays > 0 and drafter.graph_runner.replays > 0


def test_batches_beyond_the_largest_bucket_run_eagerly_and_stay_lossless(pair):
    target, draft = pair
    expected = reference(target, PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    drafter = DraftModelDrafter(draft, 4, MAX_SEQ_LEN)
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, [3], backend=FakeGraphBackend(), graph_batch_sizes=[1, 2])
    # Different lengths: four sequences run eagerly, and as they finish two or fewer fit the graphs.
    lengths = (10, 20, 30, 40)
    requests = [Request(tuple(p), SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS, lengths)]
    outputs = engine.run_until_done(requests)
    assert [outputs[r.id] for r in requests] == [full[:n] for full, n in zip(expected, lengths)]
    assert engine.graph_runner.eager_runs > 0 and engine.graph_runner.replays > 0
    assert drafter.graph_runner.eager_runs > 0 and drafter.graph_runner.replays > 0


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_sampled_requests_run_through_graphs_with_either_drafter(pair, kind):
    target, draft = pair
    drafter = DraftModelDrafter(draft, 2, MAX_SEQ_LEN) if kind == "draft_model" else NgramDrafter(1, 3)
    engine = Engine(target, drafter, 2, MAX_SEQ_LEN, [0, 3], backend=FakeGraphBackend())
    assert (getattr(drafter, "graph_runner", None) is None) == (kind == "ngram")
    greedy = Request(tuple(PROMPTS[0]), SamplingParams(max_tokens=30, ignore_eos=True))
    sampled = Request(tuple(PROMPTS[1]), SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True))
    outputs = engine.run_until_done([greedy, sampled])
    assert outputs[greedy.id] == reference(target, [PROMPTS[0]], greedy.params)[0]
    assert len(outputs[sampled.id]) == 30 and engine.graph_runner.replays > 0


# ---- the feature drafters' own forwards through graphs (CPU stand-in) -------------------------


def feature_drafter(kind: str, model, batch_size: int, window: int | None = None):
    """An untrained EAGLE-3 head or DFlash drafter (`kind`) beside the target `model`, attending
    within a sliding `window` if given."""
    from engine.drafters.dflash import DFlashDrafter, HybridDFlashDrafter
    from engine.drafters.eagle3 import Eagle3Drafter, HybridEagle3Drafter
    from tests.test_dflash import dflash_for
    from tests.test_eagle3 import head_for

    if kind in ("eagle3", "hybrid_eagle3"):
        head_class = HybridEagle3Drafter if kind == "hybrid_eagle3" else Eagle3Drafter
        return head_class(head_for(model, window=window), model, batch_size, MAX_SEQ_LEN)
    cls = HybridDFlashDrafter if kind == "hybrid_dflash" else DFlashDrafter
    return cls(dflash_for(model, window=window), model, batch_size, MAX_SEQ_LEN)


@pytest.mark.parametrize("kind", ["eagle3", "hybrid_eagle3", "dflash", "hybrid_dflash"])
def test_feature_drafters_draft_through_graphs_losslessly_and_switching_captures_nothing(pair, kind):
    """Their chain step or block forward is captured once per bucket with the first state that
    drafts, shared by every state, and replayed under k changed at random every round."""
    from tests.test_dflash import serve_switching

    target, _ = pair
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = reference(target, PROMPTS, params)
    drafter = feature_drafter(kind, target.model, 4)
    engine = Engine(target, drafter, 4, MAX_SEQ_LEN, (0, 1, 2, 3, 5), backend=FakeGraphBackend())
    buckets = default_batch_sizes(4)
    assert sorted(drafter.graphs.calls) == buckets
    captured = engine.graph_captures
    # Every state's verify and one shared drafter set; an EAGLE-3 head's chains and extends for
    # each k > 0 too, a DFlash drafter's extend after each state's verify.
    own = 8 * len(buckets) if "eagle3" in kind else 5 * len(buckets)
    assert captured == 5 * len(buckets) + len(buckets) + own
    assert serve_switching(engine, params, seed=3) == expected
    assert engine.graph_captures == captured
    assert engine.graph_runner.replays > 0
    if "eagle3" in kind:  # greedy chains replay whole; the step graphs serve sampled ones
        assert sorted(drafter.chain_graphs) == [1, 2, 3, 5]
        assert sum(g.replays for g in drafter.chain_graphs.values()) > 0
        assert all(g.eager_runs == 0 for g in drafter.chain_graphs.values())
        assert sorted(drafter.extend_graphs) == [2, 3, 4, 6]
        assert sum(g.replays for g in drafter.extend_graphs.values()) > 0
    else:  # prompts are extended eagerly, every verify's positions through the graphs
        assert drafter.graphs.replays > 0 and drafter.graphs.eager_runs == 0
        assert sorted(drafter.extend_graphs) == [1, 2, 3, 4, 6]
        assert sum(g.replays for g in drafter.extend_graphs.values()) > 0


def slotted_pair(kind: str, model, window: int | None = None):
    """Two fresh drafters of `kind` beside `model`, one to replay graphs and one eager, each with
    four slots of 5, 9, 2 and 7 entries (and a sliding `window` if given)."""
    drafters = tuple(feature_drafter(kind, model, 4, window) for _ in range(2))
    for drafter in drafters:
        for slot, length in enumerate((5, 9, 2, 7)):
            drafter.cache.allocate()
            drafter.cache.lengths[slot] = length
    return drafters


def changed_entries(before: torch.Tensor, after: torch.Tensor) -> set[tuple[int, ...]]:
    """The (slot, position) entries whose keys in the cache's first layer changed."""
    return {tuple(w) for w in after[0].ne(before[0]).flatten(2).any(-1).nonzero().tolist()}


@pytest.mark.parametrize("window", [None, 4])
def test_a_replayed_chain_step_equals_the_eager_one_and_padding_rows_touch_no_live_entry(pair, window):
    """A batch of 3 then one of 1 through the bucket of 4: the rows the first left behind are
    reset to padding, so the second replay writes only its own entry and slot 0's scratch (and a
    windowed head's replay sees the keys its eager step does)."""
    target, _ = pair
    graphed, eager = slotted_pair("eagle3", target.model, window)
    graphed.graphs = graphed.capture_graphs(FakeGraphBackend(), [4])
    for seed, (slots, tokens, step) in enumerate((([1, 2, 3], [4, 5, 6], 0), ([2], [7], 1))):
        # New entries everywhere before each replay, as verified positions overwrite chain entries.
        for drafter in (graphed, eager):
            for i, buffer in enumerate((drafter.cache.k, drafter.cache.v, drafter.next_feature)):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(3 * seed + i)))
        before = graphed.cache.k.clone()
        logits = graphed.draft(slots, tokens, step)
        torch.testing.assert_close(logits, eager.draft(slots, tokens, step), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graphed.next_feature, eager.next_feature, atol=1e-5, rtol=1e-5)
        written = changed_entries(before, graphed.cache.k)
        entries = {(s, graphed.cache.lengths[s] + step) for s in slots}
        assert entries <= written <= entries | {(0, graphed.cache.scratch_pos)}
    assert graphed.graphs.replays == 2


@pytest.mark.parametrize("window", [None, 4])
def test_a_replayed_greedy_chain_drafts_what_the_step_path_does_and_padding_touches_no_live_entry(pair, window):
    """Three chains of up to 5 drafts (one row wanting 3) then one chain, through the bucket of 4:
    the same drafts as a step at a time, and only the chains' own entries and slot 0's scratch
    written, whatever rows an earlier batch left in the bucket."""
    from types import SimpleNamespace

    target, _ = pair
    graphed, eager = slotted_pair("eagle3", target.model, window)
    graphed.chain_graphs[5] = graphed.capture_chain(FakeGraphBackend(), [4], 5)
    params = SamplingParams(max_tokens=16)
    for seed, (slots, ks) in enumerate((([1, 2, 3], [5, 3, 5]), ([2], [5]))):
        seqs = [SimpleNamespace(draft_slot=slot, params=params) for slot in slots]
        for drafter in (graphed, eager):
            buffers = (drafter.cache.k, drafter.cache.v, drafter.next_feature, drafter.next_logits)
            for i, buffer in enumerate(buffers):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(4 * seed + i)))
        before = graphed.cache.k.clone()
        replayed, stepped = [Proposal([]) for _ in slots], [Proposal([]) for _ in slots]
        assert graphed.graph_chains(seqs, ks, list(range(len(slots))), replayed)
        eager.chains(seqs, ks, list(range(len(slots))), stepped, EVERY_DRAFT)
        assert [p.tokens for p in replayed] == [p.tokens for p in stepped]
        assert [len(p.tokens) for p in replayed] == ks
        written = changed_entries(before, graphed.cache.k)
        entries = {(s, graphed.cache.lengths[s] + step) for s in slots for step in range(4)}
        assert written - {(0, graphed.cache.scratch_pos)} == entries
    assert graphed.chain_graphs[5].replays == 2


@pytest.mark.parametrize("kind, window", [("dflash", None), ("eagle3", None), ("eagle3", 4)])
def test_a_replayed_extend_makes_what_the_eager_one_does_and_padding_touches_no_live_entry(pair, kind, window):
    """Rows keeping 3 and 1 of a verify's 4 positions, then one row through the bucket of 4: the
    entries the eager extend makes (and for an EAGLE-3 head its next features and logits, which
    a windowed head's last entry computes from the keys its eager one sees), and besides the
    entries only scratch positions written."""
    from types import SimpleNamespace

    target, _ = pair
    graphed, eager = slotted_pair(kind, target.model, window)
    graphed.extend_graphs[4] = graphed.capture_extend(FakeGraphBackend(), [4], 4)
    size = target.model.config.hidden_size
    for seed, (slots, counts) in enumerate((([1, 3], [3, 1]), ([2], [4]))):
        seqs = [SimpleNamespace(draft_slot=slot, tokens=list(range(3, 23))) for slot in slots]
        generator = torch.Generator().manual_seed(seed)
        hidden = {i: torch.randn(len(slots), 4, size, generator=generator) for i in graphed.capture_layers}
        before = graphed.cache.k.clone()
        starts = [graphed.cache.lengths[s] for s in slots]
        if kind == "dflash":
            for drafter in (graphed, eager):
                drafter._extend(seqs, counts, hidden)
        else:  # the head holds a verify's states until it next drafts
            for drafter in (graphed, eager):
                drafter.hold(seqs, counts, hidden)
            graphed.graph_extend(seqs)
            assert not graphed.waiting
            eager.step(*eager.take_held(seqs), taps=True)
            for mine, theirs in ((graphed.next_feature, eager.next_feature), (graphed.next_logits, eager.next_logits)):
                torch.testing.assert_close(mine[slots], theirs[slots], atol=1e-5, rtol=1e-5)
        assert [graphed.cache.lengths[s] for s in slots] == [eager.cache.lengths[s] for s in slots]
        for slot, start, count in zip(slots, starts, counts):
            for mine, theirs in ((graphed.cache.k, eager.cache.k), (graphed.cache.v, eager.cache.v)):
                torch.testing.assert_close(mine[:, slot, : start + count], theirs[:, slot, : start + count])
        written = changed_entries(before, graphed.cache.k)
        entries = {(s, start + j) for s, start, count in zip(slots, starts, counts) for j in range(count)}
        assert entries <= written <= entries | {(s, graphed.cache.scratch_pos) for s in range(4)}
    assert graphed.extend_graphs[4].replays == 2


def test_the_dflash_block_at_fixed_shapes_sees_within_its_window_what_the_eager_one_does(pair):
    """The block a graph captures attends over each slot's whole cache row, masked: within a
    sliding window, the logits of the block forward over the context alone (PyTorch operators)."""
    target, _ = pair
    drafters = {window: slotted_pair("dflash", target.model, window)[0] for window in (9, None)}
    logits = {}
    for window, drafter in drafters.items():
        drafter.native = None  # both forwards on PyTorch operators
        for i, buffer in enumerate((drafter.cache.k, drafter.cache.v)):
            buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(i)))
        size, slots = drafter.config.block_size, [1, 3, 2]
        block = torch.full((len(slots), size), drafter.config.mask_token_id)
        block[:, 0] = torch.tensor([4, 5, 6])
        lengths = torch.tensor([[drafter.cache.lengths[s]] for s in slots])
        eager = drafter.block_logits(slots, block, size - 1)
        (fixed,) = drafter.static_block(torch.cat((block, lengths, torch.tensor(slots)[:, None]), dim=1))
        torch.testing.assert_close(fixed, eager, atol=1e-5, rtol=1e-5)
        logits[window] = eager
    # The window hides the start of the longer contexts (9 and 7 entries), not of the one of 2.
    assert not torch.allclose(logits[9][:2], logits[None][:2], atol=1e-3)
    torch.testing.assert_close(logits[9][2], logits[None][2], atol=1e-5, rtol=1e-5)


def test_the_feature_drafters_captured_bodies_read_nothing_back_to_the_host():
    """As for the target's static forward: on the meta device any host read fails."""
    model = load_tiny("llama")
    eagle3, dflash = feature_drafter("eagle3", model, 2), feature_drafter("dflash", model, 2)
    for module in (model, eagle3.model, dflash.model):
        module.to("meta")
    for cache in (eagle3.cache, dflash.cache):
        cache.k, cache.v = cache.k.to("meta"), cache.v.to("meta")
    block = dflash.config.block_size
    with torch.inference_mode():
        inputs = torch.zeros(2, 3, dtype=torch.long, device="meta")
        features, logits = eagle3.static_draft(inputs, torch.zeros(2, model.config.hidden_size, device="meta"))
        (block_logits,) = dflash.static_block(torch.zeros(2, block + 2, dtype=torch.long, device="meta"))
        taps = torch.zeros(2, 4, len(dflash.capture_layers) * model.config.hidden_size, device="meta")
        (where,) = dflash.static_extend(taps, torch.zeros(2, 3, dtype=torch.long, device="meta"))
        taps = torch.zeros(2, 4, eagle3.model.fc.in_features, device="meta")
        extended, _, _ = eagle3.static_extend(taps, torch.zeros(2, 7, dtype=torch.long, device="meta"))
    assert features.shape == (2, model.config.hidden_size) and logits.shape == (2, 64)
    assert block_logits.shape == (2, block - 1, 64) and where.shape == (2, 4)
    assert extended.shape == (2, model.config.hidden_size)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_a_feature_drafter_in_bfloat16_rotates_by_the_exact_angle(kind):
    """On an accelerator the drafters run in bfloat16 (CPU keeps float32, so nothing else here
    would notice): their RoPE angles must still be computed in float32, or keys far into a prompt
    turn by whole radians and the drafts stop matching."""
    from engine.model.dflash import load_dflash
    from engine.model.eagle3 import load_eagle3

    target = load_checkpoint(DEFAULT_TARGET, "cpu", "float32")
    load = load_dflash if kind == "dflash" else load_eagle3
    model = load(DEFAULT_TARGET.parent / kind, target.model).to(torch.bfloat16)
    positions = torch.tensor([5, 300, 1500])
    cos, sin = model.rope(positions)
    assert cos.dtype == torch.bfloat16
    inv_freq = 1.0 / (
        target.config.rope.theta ** (torch.arange(0, cos.shape[-1], 2, dtype=torch.float64) / cos.shape[-1])
    )
    angles = positions.double()[:, None] * inv_freq
    assert torch.allclose(cos[:, 0].double(), angles.cos().repeat(1, 2), atol=1e-2)
    assert torch.allclose(sin[:, 0, cos.shape[-1] // 2 :].double(), angles.sin(), atol=1e-2)
