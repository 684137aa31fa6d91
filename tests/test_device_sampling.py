"""Sampling a batch on the device (engine/sampling.py `RowSampling`, engine/verify.py
`judge_by_row`): the same distributions as the row-at-a-time path, each row's draws from its own
generator, and both rejection rules keeping the target's distribution exactly. Run here with
device operators on the CPU; the same operators serve CUDA."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from engine.core import Engine
from engine.drafters.base import Proposal
from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.request import Request, Sequence
from engine.sampling import (
    RowSampling,
    SamplingParams,
    draw_by_row,
    probs_by_row,
    sample,
    target_probs,
    uniforms,
)
from engine.verify import ROW_RULES, accept_block, judge_by_row
from tests.test_graphs import MAX_SEQ_LEN, FakeGraphBackend, feature_drafter
from tests.test_speculative import assert_follows_marginals, exact_marginals
from tests.test_verify import VOCAB, ToyPair

MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.95),
    SamplingParams(temperature=2.0, top_p=0.05),  # only the most likely token is left
    SamplingParams(temperature=0.5, top_k=1),
]


def test_each_row_gets_the_distribution_its_own_parameters_give():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MIXED), 3, 200, generator=generator) * 3
    logits[0, 0, :10] = 4.0  # ties at the top-k cut and inside the nucleus
    rows = probs_by_row(logits, RowSampling.of(MIXED, torch.device("cpu")))
    for row, params in enumerate(MIXED):
        torch.testing.assert_close(rows[row], target_probs(logits[row], params), atol=1e-6, rtol=1e-5)
    assert rows[4].count_nonzero(dim=-1).tolist() == [1, 1, 1] and rows[5].count_nonzero(dim=-1).tolist() == [1, 1, 1]


def test_a_draw_is_the_one_sample_makes_from_the_same_generator_state():
    probs = target_probs(torch.randn(64, 300, generator=torch.Generator().manual_seed(1)), MIXED[2])
    probs[3] = 0.0
    probs[3, 17] = 1.0  # a row with a single token
    seeds = range(64)
    drawn = draw_by_row(probs, uniforms([torch.Generator().manual_seed(s) for s in seeds], 1, probs.device)[:, 0])
    expected = [sample(probs[row], torch.Generator().manual_seed(s)) for row, s in enumerate(seeds)]
    assert drawn.tolist() == expected and drawn[3] == 17
    assert (probs.gather(-1, drawn[:, None]) > 0).all()


def sequences(params: SamplingParams, seeds) -> list[Sequence]:
    return [
        Sequence(Request((1,), params), slot=row, generator=torch.Generator().manual_seed(s), tokens=[1])
        for row, s in enumerate(seeds)
    ]


def test_block_verification_of_a_batch_keeps_what_each_chain_alone_keeps_from_the_same_draws():
    """Rows of several lengths (none, one, four drafts; drafted with probabilities and one-hot):
    judged together, each keeps the drafts and draws the token that `accept_block` does when its
    generator starts from the same state (the batch takes each row's draws as one block)."""
    generator = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    vocab, rows = 12, 48
    logits = torch.randn(rows, 5, vocab, generator=generator) * 2
    proposals = []
    for row in range(rows):
        n = row % 5
        tokens = torch.randint(0, vocab, (n,), generator=generator).tolist()
        probs = torch.softmax(torch.randn(n, vocab, generator=generator), dim=-1) if row % 2 else None
        proposals.append(Proposal(tokens, probs))
    emitted = judge_by_row(logits, sequences(params, range(rows)), proposals, "block")
    for row, proposal in enumerate(proposals):
        p = target_probs(logits[row, : len(proposal.tokens) + 1], params)
        alone = accept_block(p, proposal, torch.Generator().manual_seed(row))
        assert emitted[row] == alone, row
    assert {len(e) - 1 for e in emitted} > {0}  # some rows kept drafts


def chains_of(pair: ToyPair, n: int) -> list[tuple[tuple[int, ...], float]]:
    return list(pair.chains(lambda chain: len(chain) == n))


@pytest.mark.parametrize("verification", ["block", "token"])
@pytest.mark.parametrize("n", [1, 3])
def test_both_rules_over_a_batch_emit_the_targets_distribution(verification, n):
    """Chains drafted from a toy drafter whose distributions depend on the whole prefix, judged
    in one batch of 60,000 rows, and each row sampled on from the target to three tokens: the
    three tokens' joint distribution against the target's, chi-square."""
    pair, rows, length = ToyPair(seed=n), 60_000, 3
    chains = chains_of(pair, n)
    generator = torch.Generator().manual_seed(7)
    picked = torch.multinomial(torch.tensor([m for _, m in chains]), rows, replacement=True, generator=generator)
    table_p = torch.stack([torch.stack([pair.target(c[:i]) for i in range(n + 1)]) for c, _ in chains])
    table_q = torch.stack([torch.stack([pair.drafter(c[:i]) for i in range(n)]) for c, _ in chains])
    drafts_of = torch.tensor([c for c, _ in chains])
    p, q, drafts = table_p[picked], table_q[picked], drafts_of[picked]
    counts = torch.full((rows,), n)
    u = torch.rand(rows, n + 1, dtype=torch.float64, generator=generator)
    kept, dist = ROW_RULES[verification](p, q, drafts, counts, u[:, :n])
    token = draw_by_row(dist, u[:, n])
    observed: dict[tuple[int, ...], int] = {}
    for chain, k, t in zip(drafts.tolist(), kept.tolist(), token.tolist()):
        out = (*chain[:k], t)
        while len(out) < length:  # the target samples on
            out = (*out, sample(pair.target(out), generator))
        observed[out[:length]] = observed.get(out[:length], 0) + 1
    chi2 = 0.0
    for tokens in itertools.product(range(VOCAB), repeat=length):
        mass = 1.0
        for i, token_i in enumerate(tokens):
            mass *= float(pair.target(tokens[:i])[token_i])
        expected = mass * rows
        chi2 += (observed.get(tokens, 0) - expected) ** 2 / expected
    # 26 degrees of freedom: p = 0.001 at 54.1; a biased rule misses by far more.
    assert chi2 < 54.1, chi2
    assert 0 < float(kept.float().mean()) < n


def test_the_rules_agree_on_what_a_chain_keeps_on_average_as_the_row_at_a_time_rules_do():
    """Block verification keeps at least as many drafts as the token rule on chains of three."""
    pair, rows = ToyPair(seed=4), 40_000
    chains = chains_of(pair, 3)
    generator = torch.Generator().manual_seed(5)
    picked = torch.multinomial(torch.tensor([m for _, m in chains]), rows, replacement=True, generator=generator)
    p = torch.stack([torch.stack([pair.target(c[:i]) for i in range(4)]) for c, _ in chains])[picked]
    q = torch.stack([torch.stack([pair.drafter(c[:i]) for i in range(3)]) for c, _ in chains])[picked]
    drafts = torch.tensor([c for c, _ in chains])[picked]
    u = torch.rand(rows, 3, dtype=torch.float64, generator=generator)
    counts = torch.full((rows,), 3)
    block, _ = ROW_RULES["block"](p, q, drafts, counts, u)
    token, _ = ROW_RULES["token"](p, q, drafts, counts, u)
    assert float(block.double().mean()) > float(token.double().mean()) + 0.01


# ---- the engine, drawing on the device through graphs (the CPU stand-in of tests/test_graphs.py) ----


class FakeDeviceBackend(FakeGraphBackend):
    samples_on_device = True


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """tests/conftest.py's tiny_vocab_pair on PyTorch operators, as graphs capture them."""
    from engine.checkpoint import load_checkpoint
    from tests.conftest import perturbed_copy, save_tiny, tiny_hf_model

    root = tmp_path_factory.mktemp("small_vocab")
    target_dir = save_tiny(tiny_hf_model("qwen2", vocab_size=8, initializer_range=0.3), root / "target")
    draft_dir = perturbed_copy(target_dir, root / "draft", scale=1.0)
    return load_checkpoint(target_dir, native_forward=False), load_checkpoint(draft_dir, native_forward=False)


def drafter_of(kind: str, target, draft, batch_size: int):
    if kind == "draft_model":
        return DraftModelDrafter(draft, batch_size, MAX_SEQ_LEN)
    if kind == "ngram":
        return NgramDrafter(1, 3)
    return feature_drafter(kind, target.model, batch_size)


@pytest.mark.parametrize("verification", ["block", "token"])
@pytest.mark.parametrize("kind", ["eagle3", "dflash", "draft_model", "ngram"])
def test_sampled_requests_drawn_on_the_device_keep_the_targets_distribution(
    small_vocab_pair, kind, verification, monkeypatch
):
    """Every verification judged in one batch on the device, the EAGLE-3 head's sampled chains
    replayed whole from their graphs, DFlash's blocks and the draft model's steps drawn together:
    chi-square of the 2nd and 3rd sampled tokens against the target's exact marginals."""
    import engine.verify

    target, draft = small_vocab_pair
    prompt = tuple(range(8)) * 2  # every token has occurred: the n-gram drafter always proposes
    base = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True)
    with torch.inference_mode():
        marginals = exact_marginals(target, prompt, base, 3)
    batches = []
    judge = engine.verify.judge_by_row
    monkeypatch.setattr(
        engine.verify, "judge_by_row", lambda logits, *a: batches.append(len(logits)) or judge(logits, *a)
    )
    drafter = drafter_of(kind, target, draft, 16)
    engine_ = Engine(target, drafter, 16, 32, [2], backend=FakeDeviceBackend(), verification=verification)
    assert drafter.samples_on_device
    requests = [
        Request(prompt, SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True))
        for s in range(1500)
    ]
    outputs = engine_.run_until_done(requests)
    stats = engine_.states[2].stats
    assert 0 < stats.drafts_accepted < stats.drafts_proposed
    assert len(batches) == stats.rounds and max(batches) == 16  # every round's rows judged in one batch
    if kind == "eagle3":
        assert drafter.sampled_chain_graphs[2].replays > 0 and drafter.graphs.replays == 0
    assert_follows_marginals(outputs, requests, marginals)


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "draft_model"])
def test_a_seed_drawn_on_the_device_repeats_its_output(small_vocab_pair, kind):
    target, draft = small_vocab_pair
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=6, seed=11, ignore_eos=True)
    served = []
    for _ in range(2):
        engine_ = Engine(target, drafter_of(kind, target, draft, 2), 2, 32, [3], backend=FakeDeviceBackend())
        requests = [Request(tuple(range(8)), params), Request(tuple(range(8)), replace(params, seed=12))]
        outputs = engine_.run_until_done(requests)
        served.append([outputs[r.id] for r in requests])
    assert served[0] == served[1] and served[0][0] != served[0][1]


# ---- on a GPU --------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("verification", ["block", "token"])
def test_on_cuda_the_rules_decide_what_they_decide_on_the_cpu(verification):
    generator = torch.Generator().manual_seed(3)
    rows, n, vocab = 256, 4, 50
    p = torch.softmax(torch.randn(rows, n + 1, vocab, generator=generator, dtype=torch.float64), dim=-1)
    q = torch.softmax(torch.randn(rows, n, vocab, generator=generator, dtype=torch.float64), dim=-1)
    drafts = torch.randint(0, vocab, (rows, n), generator=generator)
    counts = torch.randint(0, n + 1, (rows,), generator=generator)
    u = torch.rand(rows, n + 1, dtype=torch.float64, generator=generator)
    here = ROW_RULES[verification](p, q, drafts, counts, u[:, :n])
    there = ROW_RULES[verification](*(t.cuda() for t in (p, q, drafts, counts, u[:, :n])))
    assert torch.equal(here[0], there[0].cpu())
    torch.testing.assert_close(here[1], there[1].cpu())
    params = [MIXED[row % len(MIXED)] for row in range(rows)]
    logits = torch.randn(rows, vocab, generator=generator) * 3
    cpu = probs_by_row(logits, RowSampling.of(params, torch.device("cpu")))
    gpu = probs_by_row(logits.cuda(), RowSampling.of(params, torch.device("cuda")))
    torch.testing.assert_close(cpu, gpu.cpu(), atol=1e-6, rtol=1e-5)
    assert torch.equal(draw_by_row(cpu, u[:, 0]), draw_by_row(cpu.cuda(), u[:, 0].cuda()).cpu())


@cuda
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_on_cuda_sampled_requests_through_graphs_keep_the_targets_distribution(tmp_path, kind):
    """The tiny 8-token pair on the GPU, CUDA graphs and device draws throughout: chi-square of
    the 2nd and 3rd sampled tokens against the target's exact marginals."""
    from engine.checkpoint import load_checkpoint
    from engine.drafters.dflash import DFlashDrafter
    from engine.drafters.eagle3 import Eagle3Drafter
    from tests.conftest import save_tiny, tiny_hf_model
    from tests.test_dflash import dflash_for
    from tests.test_eagle3 import head_for

    target = load_checkpoint(
        save_tiny(tiny_hf_model("qwen2", vocab_size=8, initializer_range=0.3), tmp_path / "target"), "cuda", "float32"
    )
    prompt = tuple(range(8)) * 2
    base = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True)
    with torch.inference_mode():
        marginals = exact_marginals(target, prompt, base, 3)
    model = target.model
    if kind == "eagle3":
        drafter = Eagle3Drafter(head_for(model).to("cuda"), model, 16, 32)
    else:
        drafter = DFlashDrafter(dflash_for(model).to("cuda"), model, 16, 32)
    engine_ = Engine(target, drafter, 16, 32, [2])
    assert engine_.backend.samples_on_device and drafter.samples_on_device
    requests = [
        Request(prompt, SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True))
        for s in range(1500)
    ]
    outputs = engine_.run_until_done(requests)
    if kind == "eagle3":
        assert drafter.sampled_chain_graphs[2].replays > 0
    assert_follows_marginals(outputs, requests, marginals)


def test_the_sampled_chain_graphs_body_reads_nothing_back_to_the_host():
    """As tests/test_graphs.py checks the greedy chain's: on the meta device any host read fails."""
    from tests.test_graphs import load_tiny

    model = load_tiny("llama")
    head = feature_drafter("eagle3", model, 2)
    model.to("meta")
    head.model.to("meta")
    head.cache.k, head.cache.v = head.cache.k.to("meta"), head.cache.v.to("meta")
    head.next_feature, head.next_logits = head.next_feature.to("meta"), head.next_logits.to("meta")
    head.draft_ids = head.draft_ids.to("meta")
    meta = torch.device("meta")
    with torch.inference_mode():
        rows = RowSampling(
            torch.ones(2, device=meta), torch.zeros(2, dtype=torch.long, device=meta), torch.ones(2, device=meta)
        )
        inputs = torch.zeros(2, 2, dtype=torch.long, device=meta)
        drawn = torch.zeros(2, 3, dtype=torch.float64, device=meta)
        tokens, probs = head.static_sampled_chain(inputs, drawn, rows.temperature, rows.top_k, rows.top_p, steps=2)
    assert tokens.shape == (2, 3) and probs.shape == (2, 3, head.model.config.draft_vocab_size)
