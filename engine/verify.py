"""Verification: which drafts the target keeps, and the token it adds after them.

Greedy: keep drafts while each equals the target's argmax, then emit the target's argmax.

Sampling, two ways; both emit tokens distributed exactly as target-only sampling:

- `token` (Leviathan et al. 2023; Chen et al. 2023): draft x with draft probability q(x) is kept
  with probability min(1, p(x)/q(x)); at the first rejection the token comes from
  normalise(max(0, p - q)); when every draft is kept, a bonus token comes from p.
- `block` (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding"): the chain is
  judged as a whole. A draft the token rule would reject can still be kept when the drafts after
  it make up for it, so a round keeps at least as many drafts on average (the paper proves it
  optimal among lossless rules that see one chain), and the longer the chain, the more it gains.
  It draws a number for every draft, and each position it falls back through costs a pass over
  the vocabulary: judging a chain of three took 79 us a row against 45 us for `token` on the
  development machine, paid back only where chains run beyond about three drafts.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from engine.drafters.base import Proposal
from engine.request import Sequence
from engine.sampling import sample, target_probs


def verify(
    logits: Tensor,
    seqs: Seq[Sequence],
    proposals: Seq[Proposal],
    verification: str = "block",
    argmax: Tensor | None = None,
) -> list[list[int]]:
    """For each sequence, the drafts it keeps followed by the target's own token.

    `logits[i, j]` is the target's prediction after the pending token and the first j drafts;
    `verification` ("block" or "token") is how sampled chains are judged; `argmax`, where the
    forward computed it, is `logits.argmax(-1)`.
    """
    accept_chain = CHAIN_RULES[verification]
    greedy_rows = None
    if any(s.params.greedy for s in seqs):
        greedy_rows = (argmax if argmax is not None else logits.argmax(dim=-1)).tolist()
    emitted = []
    for row, (seq, proposal) in enumerate(zip(seqs, proposals)):
        if seq.params.greedy:
            emitted.append(accept_greedy(greedy_rows[row], proposal.tokens))
        else:
            n = len(proposal.tokens)
            emitted.append(accept_chain(target_probs(logits[row, : n + 1], seq.params), proposal, seq.generator))
    return emitted


def accept_greedy(target_argmax: list[int], drafts: list[int]) -> list[int]:
    kept = 0
    while kept < len(drafts) and drafts[kept] == target_argmax[kept]:
        kept += 1
    return drafts[:kept] + [target_argmax[kept]]


def accept_sampled(p: Tensor, proposal: Proposal, generator: torch.Generator | None) -> list[int]:
    """Token verification of one chain; `p` is [len(drafts) + 1, V]."""
    out: list[int] = []
    for j, token in enumerate(proposal.tokens):
        q_token = drafted_chance(proposal, j)
        p_token = float(p[j, token])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_token < p_token:  # u < p/q without dividing by a zero q
            out.append(token)
            continue
        out.append(sample_residual(residual(p, proposal, j), p[j], generator))
        return out
    out.append(sample(p[len(proposal.tokens)], generator))
    return out


def accept_block(p: Tensor, proposal: Proposal, generator: torch.Generator | None) -> list[int]:
    """Block verification of one chain; `p` is [len(drafts) + 1, V].

    Each draft position i gets an independent uniform draw, and the chain is kept up to the last
    i whose draw falls under `block_keep` there (none: no draft is kept). The positions are
    tried from the end of the chain, so a round that keeps its drafts reads only scalars."""
    drafts = proposal.tokens
    n = len(drafts)
    if n == 0:
        return [sample(p[0], generator)]
    weights = block_weights(p, proposal)
    draws = torch.rand(n, generator=generator, dtype=torch.float64, device=p.device).tolist()
    if draws[-1] < weights[n]:
        return [*drafts, sample(p[n], generator)]
    for kept in range(n - 1, 0, -1):
        spare = residual(p, proposal, kept, weights[kept])
        if draws[kept - 1] < block_keep(spare, weights[kept]):
            return [*drafts[:kept], sample_residual(spare, p[kept], generator)]
    return [sample_residual(residual(p, proposal, 0), p[0], generator)]


def block_weights(p: Tensor, proposal: Proposal) -> list[float]:
    """How far the target backs the first i drafts, for i = 0..n: weight[0] = 1 and
    weight[i] = min(1, weight[i-1] * p(x_i) / q(x_i)). (The token rule keeps all of the first
    i drafts with the product of their min(1, p/q); block verification keeps the running product
    capped at 1, so a draft the target likes more than the drafter does makes up for one before.)"""
    weights = [1.0]
    for j, token in enumerate(proposal.tokens):
        q_token = drafted_chance(proposal, j)
        backed = weights[-1] * float(p[j, token])
        weights.append(1.0 if backed >= q_token else backed / q_token)
    return weights


def drafted_chance(proposal: Proposal, j: int) -> float:
    """The drafter's probability q(x) of its draft at position j (1 where it is deterministic)."""
    return 1.0 if proposal.probs is None else float(proposal.probs[j, proposal.tokens[j]])


def block_keep(spare: Tensor, weight: float) -> float:
    """The chance that block verification keeps a chain up to draft i (i < n), given that it keeps
    none of the drafts after it: spare / (spare + 1 - weight[i]), where spare is the target's mass
    beyond the drafter at the next position, max(0, weight[i] * p - q) (`residual`)."""
    mass = float(spare.sum())
    total = mass + 1.0 - weight
    # Nothing spare: every draft so far is fully backed and the next position's p equals q.
    return mass / total if total > 0 else 1.0


def residual(p: Tensor, proposal: Proposal, j: int, weight: float = 1.0) -> Tensor:
    """max(0, weight * p - q) at draft position j: where the target's token comes from when the
    drafts stop there (unnormalised; q is one-hot where the drafter is deterministic)."""
    if proposal.probs is None:
        spare = p[j] * weight  # weight * p <= 1 everywhere: only the drafted token's share goes
        spare[proposal.tokens[j]] = 0.0
        return spare
    return (weight * p[j] - proposal.probs[j]).clamp_(min=0.0)


def sample_residual(spare: Tensor, p: Tensor, generator: torch.Generator | None) -> int:
    """A token from the unnormalised `spare`; where it has no mass, p == q up to rounding, the
    rejection was a rounding artefact, and p itself is exact."""
    mass = spare.sum()
    return sample(spare / mass if mass > 0 else p, generator)


# How a sampled chain is judged, by the name `[engine] verification` gives it.
CHAIN_RULES = {"block": accept_block, "token": accept_sampled}
