"""Target-only sampling: seeds, top-k and top-p, the distribution drawn from, EOS."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.generate import generate
from engine.native.build import library, problem
from engine.sampling import SamplingParams, nucleus, nucleus_by_operators, sample, target_probs
from tests.conftest import forward_one


def test_same_seed_same_text_and_different_seed_differs(tiny_llama):
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=7, ignore_eos=True)
    first = generate(tiny_llama, [[3, 4]], params)[0].tokens
    again = generate(tiny_llama, [[3, 4]], params)[0].tokens
    other = generate(tiny_llama, [[3, 4]], SamplingParams(max_tokens=32, temperature=1.0, seed=8, ignore_eos=True))
    assert first == again
    assert other[0].tokens != first


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    top2 = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[2:] == 0).all() and top2[:2].sum().item() == pytest.approx(1.0)
    probs = torch.softmax(logits, -1)
    nucleus = target_probs(logits, SamplingParams(temperature=1.0, top_p=float(probs[0]) + 1e-3))
    assert (nucleus > 0).tolist() == [True, True, False, False, False]


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
@pytest.mark.parametrize("spread", [0.1, 1.0, 8.0])
@pytest.mark.parametrize("by", ["kernels", "operators"])
def test_top_p_keeps_the_smallest_prefix_of_the_sorted_vocabulary(top_p, spread, by):
    """The nucleus is what sorting the whole vocabulary and cutting where the mass reaches top_p
    gives, also where it holds most of a flat vocabulary (more than the first tokens looked at):
    from the compiled kernels (what target_probs uses on a CPU) and from tensor operators."""
    if by == "kernels" and library() is None:
        pytest.skip(f"no compiled kernels: {problem()}")
    torch.manual_seed(int(spread * 10))
    logits = torch.randn(3, 8192) * spread
    probs = torch.softmax(logits, -1)
    ordered, order = probs.sort(dim=-1, descending=True)
    ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered >= top_p, 0.0)
    expected = torch.zeros_like(probs).scatter_(-1, order, ordered)
    expected = expected / expected.sum(-1, keepdim=True)
    if by == "kernels":
        got = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    else:
        got = nucleus_by_operators(probs, top_p)
    assert torch.equal(got > 0, expected > 0)
    assert torch.allclose(got, expected, atol=1e-7)


@pytest.mark.skipif(library() is None, reason="no compiled kernels")
def test_the_compiled_top_p_keeps_zeros_out_and_cuts_ties_by_mass():
    """Tokens of probability 0 (masked by top-k or outside a draft vocabulary) are never kept, and
    where top_p falls among equally likely tokens both filters keep as many of them."""
    logits = torch.full((2, 8192), -30.0)
    logits[0, 1::2] = float("-inf")  # half the vocabulary impossible
    logits[0, :64:2] = torch.linspace(4.0, 1.0, 32)
    logits[1, 100:140] = 3.0  # 40 ties hold most of the mass
    probs = torch.softmax(logits, -1)
    for top_p in (0.5, 0.95):
        got, want = nucleus(probs, top_p), nucleus_by_operators(probs, top_p)
        assert not (got[0, 1::2] > 0).any()
        assert torch.equal((got > 0).sum(-1), (want > 0).sum(-1))
        assert torch.allclose(got.sort(-1).values, want.sort(-1).values, atol=1e-7)


def test_sampled_tokens_follow_the_distribution(tiny_llama):
    """Target-only sampling of the first token matches softmax(logits / T) (chi-square)."""
    prompt = [3, 4, 5]
    cache = tiny_llama.model.new_cache(1, 8)
    slot = cache.allocate()
    with torch.no_grad():
        probs = target_probs(forward_one(tiny_llama.model, cache, slot, prompt)[-1], SamplingParams(temperature=0.8))
    draws = 1500
    counts = Counter()
    for seed in range(draws):
        params = SamplingParams(max_tokens=1, temperature=0.8, seed=seed, ignore_eos=True)
        counts[generate(tiny_llama, [prompt], params)[0].tokens[0]] += 1
    expected = probs * draws
    keep = expected >= 5
    observed = torch.tensor([counts[i] for i in range(len(probs))], dtype=torch.float)
    chi2 = (((observed - expected) ** 2 / expected)[keep]).sum().item()
    chi2 += ((observed[~keep].sum() - expected[~keep].sum()) ** 2 / max(expected[~keep].sum().item(), 1e-9)).item()
    dof = int(keep.sum())
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)


def test_sample_follows_unnormalised_weights_and_never_draws_a_zero_weight_token():
    # Weights as a rejection's residual leaves them: zeros among them, not summing to 1.
    weights = torch.tensor([0.0, 0.3, 0.0, 0.1, 0.6, 0.0]) * 0.5
    generator = torch.Generator().manual_seed(0)
    draws = 6000
    counts = Counter(sample(weights, generator) for _ in range(draws))
    assert set(counts) == {1, 3, 4}
    expected = {1: 0.3 * draws, 3: 0.1 * draws, 4: 0.6 * draws}
    chi2 = sum((counts[t] - e) ** 2 / e for t, e in expected.items())
    assert chi2 < 13.8, counts  # p = 0.001 at 2 degrees of freedom
    # A weight only at the very end of the row is found too.
    assert sample(torch.tensor([0.0, 0.0, 0.0, 2.0]), generator) == 3


def test_sample_with_a_seeded_generator_repeats_itself():
    weights = torch.softmax(torch.randn(8192, generator=torch.Generator().manual_seed(1)), dim=0)
    first = [sample(weights, torch.Generator().manual_seed(7)) for _ in range(3)]
    runs = [sample(weights, g) for g in [torch.Generator().manual_seed(7)] for _ in range(20)]
    again = [sample(weights, g) for g in [torch.Generator().manual_seed(7)] for _ in range(20)]
    assert len(set(first)) == 1 and runs == again and len(set(runs)) > 1


def test_eos_stops_generation(tiny_llama):
    params = SamplingParams(max_tokens=40)
    full = generate(tiny_llama, [[3, 4]], SamplingParams(max_tokens=40, ignore_eos=True))[0].tokens
    eos = full[5]
    tiny_llama.eos_token_ids = frozenset({eos})
    try:
        stopped = generate(tiny_llama, [[3, 4]], params)[0]
    finally:
        tiny_llama.eos_token_ids = frozenset()
    assert stopped.tokens == full[: full.index(eos) + 1]
    assert stopped.finish_reason == "stop"
