"""Sampled verification: block verification keeps the target's distribution exactly, whatever
the chain's length and wherever the drafter stops, and never keeps fewer drafts than the token
rule. Checked exactly, by enumerating every draft chain and every outcome on a tiny vocabulary."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
import torch

from engine.drafters.base import Proposal
from engine.verify import block_keep, block_weights, residual

VOCAB = 3


class ToyPair:
    """A target p and a drafter q over VOCAB tokens whose next-token distributions depend on the
    whole prefix (random, fixed by the seed), as a language model's do."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.p: dict[tuple[int, ...], torch.Tensor] = {}
        self.q: dict[tuple[int, ...], torch.Tensor] = {}

    def _draw(self) -> torch.Tensor:
        weights = torch.tensor([self.rng.random() ** 2 for _ in range(VOCAB)], dtype=torch.float64)
        return weights / weights.sum()

    def target(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return self.p.setdefault(prefix, self._draw())

    def drafter(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return self.q.setdefault(prefix, self._draw())

    def chains(self, stop: Callable[[tuple[int, ...]], bool]):
        """Every draft chain the drafter can propose (drafting until `stop`), with its probability."""

        def grow(prefix: tuple[int, ...], mass: float):
            if stop(prefix):
                yield prefix, mass
                return
            for token, chance in enumerate(self.drafter(prefix).tolist()):
                yield from grow((*prefix, token), mass * chance)

        yield from grow((), 1.0)

    def odds(self, chain: tuple[int, ...]) -> tuple[list[float], list[torch.Tensor]]:
        """Block verification's chance of keeping the chain up to each draft i = 0..n (given no
        later draft is kept; unused at 0) and where the next token comes from after i drafts."""
        p = torch.stack([self.target(chain[:i]) for i in range(len(chain) + 1)])
        proposal = Proposal(list(chain), probs=torch.stack([self.drafter(chain[:i]) for i in range(len(chain))]))
        weights = block_weights(p, proposal)
        n = len(chain)
        spares = [residual(p, proposal, i, weights[i]) for i in range(n)]
        keep = [0.0, *(block_keep(spares[i], weights[i]) for i in range(1, n)), weights[n]]
        following = [*(spare / spare.sum() for spare in spares), p[n]]
        return keep, following


def kept_distribution(keep: list[float]) -> list[float]:
    """P(exactly the first i drafts are kept) for i = 0..n: the last i whose draw falls under keep[i]."""
    n = len(keep) - 1
    chances = []
    for kept in range(n + 1):
        chance = keep[kept] if kept else 1.0
        for later in keep[kept + 1 :]:
            chance *= 1 - later
        chances.append(chance)
    return chances


def block_output(pair: ToyPair, stop, length: int) -> dict[tuple[int, ...], float]:
    """The exact distribution of the first `length` tokens when one round is block-verified and
    the target samples on from there."""
    out: dict[tuple[int, ...], float] = {}

    def sample_on(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) >= length:
            out[prefix[:length]] = out.get(prefix[:length], 0.0) + mass
            return
        for token, chance in enumerate(pair.target(prefix).tolist()):
            sample_on((*prefix, token), mass * chance)

    for chain, mass in pair.chains(stop):
        keep, following = pair.odds(chain)
        for kept, chance in enumerate(kept_distribution(keep)):
            if chance == 0:
                continue
            for token, share in enumerate(following[kept].tolist()):
                sample_on((*chain[:kept], token), mass * chance * share)
    return out


def target_output(pair: ToyPair, length: int) -> dict[tuple[int, ...], float]:
    out = {}
    for tokens in itertools.product(range(VOCAB), repeat=length):
        mass = 1.0
        for i, token in enumerate(tokens):
            mass *= float(pair.target(tokens[:i])[token])
        out[tokens] = mass
    return out


STOPS = {
    "one draft": lambda chain: len(chain) == 1,
    "three drafts": lambda chain: len(chain) == 3,
    # A drafter that decides from its own drafts where to stop, as a confidence stop would.
    "stops after token 0": lambda chain: len(chain) == 4 or (len(chain) > 0 and chain[-1] == 0),
}


@pytest.mark.parametrize("stop", STOPS, ids=list(STOPS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_verification_samples_exactly_the_targets_distribution(seed, stop):
    pair = ToyPair(seed)
    expected = target_output(pair, 5)
    got = block_output(pair, STOPS[stop], 5)
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-12)
    assert max(abs(got.get(tokens, 0.0) - mass) for tokens, mass in expected.items()) < 1e-12


def token_rule_kept(pair: ToyPair, chain: tuple[int, ...]) -> float:
    """Expected drafts kept by the token rule: each kept with min(1, p/q) while all before were."""
    expected, running = 0.0, 1.0
    for i, token in enumerate(chain):
        running *= min(1.0, float(pair.target(chain[:i])[token] / pair.drafter(chain[:i])[token]))
        expected += running
    return expected


@pytest.mark.parametrize("seed", range(5))
def test_block_verification_keeps_more_drafts_than_the_token_rule_on_longer_chains(seed):
    pair = ToyPair(seed)
    for length, gains in ((1, False), (3, True)):
        block = token = 0.0
        for chain, mass in pair.chains(lambda c, n=length: len(c) == n):
            keep, _ = pair.odds(chain)
            block += mass * sum(i * chance for i, chance in enumerate(kept_distribution(keep)))
            token += mass * token_rule_kept(pair, chain)
        if gains:
            assert block > token + 1e-3
        else:  # a single draft: both rules are the same min(1, p/q)
            assert block == pytest.approx(token, abs=1e-12)


def test_a_deterministic_draft_is_judged_as_a_one_hot_distribution():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    lookup = Proposal([1, 1])  # no probabilities: the drafter's distribution is one-hot
    weights = block_weights(p, lookup)
    assert weights == pytest.approx([1.0, 0.3, 0.18])
    # After the first draft the target has 0.3 * (0.1 + 0.3) = 0.12 beyond the drafter's choice.
    spare = residual(p, lookup, 1, weights[1])
    assert spare.tolist() == pytest.approx([0.03, 0.0, 0.09])
    assert block_keep(spare, weights[1]) == pytest.approx(0.12 / (0.12 + 0.7))
    assert residual(p, lookup, 0).tolist() == pytest.approx([0.5, 0.0, 0.2])
