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
from engine.sampling import RowSampling, draw_by_row, probs_by_row, sample, target_probs, uniforms


def verify(
    logits: Tensor,
    seqs: Seq[Sequence],
    proposals: Seq[Proposal],
    verification: str = "block",
    argmax: Tensor | None = None,
    on_device: bool = False,
) -> list[list[int]]:
    """For each sequence, the drafts it keeps followed by the target's own token.

    `logits[i, j]` is the target's prediction after the pending token and the first j drafts;
    `verification` ("block" or "token") is how sampled chains are judged; `argmax`, where the
    forward computed it, is `logits.argmax(-1)`. `on_device` judges the sampled chains together
    with device operators (`judge_by_row`), as an accelerator wants; else a row at a time.
    """
    accept_chain = CHAIN_RULES[verification]
    greedy_rows = None
    if any(s.params.greedy for s in seqs):
        greedy_rows = (argmax if argmax is not None else logits.argmax(dim=-1)).tolist()
    sampled = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
    judged = {}
    if on_device and sampled:
        rows = [seqs[r] for r in sampled], [proposals[r] for r in sampled]
        judged = dict(zip(sampled, judge_by_row(logits[sampled], *rows, verification)))
    emitted = []
    for row, (seq, proposal) in enumerate(zip(seqs, proposals)):
        if seq.params.greedy:
            emitted.append(accept_greedy(greedy_rows[row], proposal.tokens))
        elif row in judged:
            emitted.append(judged[row])
        else:
            n = len(proposal.tokens)
            emitted.append(accept_chain(target_probs(logits[row, : n + 1], seq.params), proposal, seq.generator))
    return emitted


def judge_by_row(logits: Tensor, seqs: Seq[Sequence], proposals: Seq[Proposal], verification: str) -> list[list[int]]:
    """Sampled chains judged together with device operators: the target's probabilities of every
    row at once (`probs_by_row`), each row's draws taken first from its own generator (n for the
    rule, one for the token after), the rule over all rows as tensors, and one read back."""
    device, n = logits.device, max(len(p.tokens) for p in proposals)
    p = probs_by_row(logits[:, : n + 1], RowSampling.of([s.params for s in seqs], device)).double()
    counts = torch.tensor([len(x.tokens) for x in proposals], device=device)
    padded = [x.tokens + [0] * (n - len(x.tokens)) for x in proposals]
    drafts = torch.tensor(padded, dtype=torch.long, device=device).view(len(proposals), n)
    q = torch.zeros_like(p[:, :n])
    for row, proposal in enumerate(proposals):  # a deterministic drafter's q is one-hot
        if proposal.probs is not None:
            q[row, : len(proposal.tokens)] = proposal.probs[: len(proposal.tokens)].double()
        else:
            q[row].scatter_(-1, drafts[row, :, None], 1.0)
    u = uniforms([s.generator for s in seqs], n + 1, device)
    kept, dist = ROW_RULES[verification](p, q, drafts, counts, u[:, :n])
    token = draw_by_row(dist, at(u, counts))  # the draw after the row's own n, as a row alone takes it
    ends = torch.stack((kept, token)).tolist()  # the one read back
    return [[*x.tokens[:k], t] for x, k, t in zip(proposals, *ends)]


def chances(p: Tensor, q: Tensor, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """p(x) and q(x) of each row's drafts x [rows, n]."""
    n = drafts.shape[1]
    return p[:, :n].gather(-1, drafts[..., None])[..., 0], q.gather(-1, drafts[..., None])[..., 0]


def at(x: Tensor, index: Tensor) -> Tensor:
    """x[row, index[row]] for each row of x [rows, positions, ...]."""
    return x[torch.arange(x.shape[0], device=x.device), index]


def token_by_row(p: Tensor, q: Tensor, drafts: Tensor, counts: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """The token rule over rows: p [rows, n+1, V], q [rows, n, V], drafts [rows, n] (rows
    shorter than n padded past counts), u [rows, n]. Returns the drafts kept [rows] and the
    distribution the token after them comes from [rows, V] (unnormalised)."""
    n = drafts.shape[1]
    p_x, q_x = chances(p, q, drafts)
    inside = torch.arange(n, device=p.device)[None, :] < counts[:, None]
    kept = ((u * q_x < p_x) & inside).long().cumprod(dim=-1).sum(dim=-1)
    spare = (at(p, kept) - at(q, kept.clamp(max=max(n - 1, 0)))).clamp(min=0) if n else at(p, kept)
    return kept, following(at(p, kept), spare, kept == counts)


def block_by_row(p: Tensor, q: Tensor, drafts: Tensor, counts: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Block verification over rows, as `accept_block` judges one chain (arguments as
    `token_by_row`): kept up to the last i whose draw falls under its chance, the whole chain where
    the last draft's draw falls under its weight."""
    rows, n = drafts.shape
    if n == 0:
        return counts, at(p, counts)
    p_x, q_x = chances(p, q, drafts)
    weights = [torch.ones(rows, dtype=p.dtype, device=p.device)]
    for j in range(n):
        backed = weights[-1] * p_x[:, j]
        weights.append(torch.where(backed >= q_x[:, j], 1.0, backed / q_x[:, j]))
    weight = torch.stack(weights, dim=-1)  # [rows, n + 1]
    spares = (weight[:, :n, None] * p[:, :n] - q).clamp(min=0)  # [rows, n, V]
    mass = spares.sum(dim=-1)
    total = mass + 1.0 - weight[:, :n]
    keep = torch.where(total > 0, mass / total.clamp(min=1e-300), 1.0)  # block_keep at each i
    positions = torch.arange(n, device=p.device)[None, :]
    # Kept up to i (1 <= i < count) where draw i - 1 falls under keep[i]; the last such i wins.
    under = torch.zeros_like(keep, dtype=torch.bool)
    under[:, 1:] = u[:, : n - 1] < keep[:, 1:]
    partial = torch.where(under & (positions < counts[:, None]), positions, 0).amax(dim=-1)
    last = (counts - 1).clamp(min=0)
    whole = (counts == 0) | (at(u, last) < at(weight, counts))
    kept = torch.where(whole, counts, partial)
    return kept, following(at(p, kept), at(spares, kept.clamp(max=n - 1)), whole)


def following(p_at: Tensor, spare: Tensor, whole: Tensor) -> Tensor:
    """Where the token after the kept drafts comes from: p where every draft was kept, else the
    spare mass (p itself where there is none: the rejection was a rounding artefact)."""
    empty = spare.sum(dim=-1, keepdim=True) <= 0
    return torch.where(whole[:, None] | empty, p_at, spare)


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


# How a sampled chain is judged, by the name `[engine] verification` gives it: a row at a time, or
# every row together on the device.
CHAIN_RULES = {"block": accept_block, "token": accept_sampled}
ROW_RULES = {"block": block_by_row, "token": token_by_row}
