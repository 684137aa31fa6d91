"""Verification: which drafts the target keeps, and the token it adds after them.

Greedy: keep drafts while each equals the target's argmax, then emit the target's argmax.
Sampling: standard rejection sampling. Draft x with draft probability q(x) is kept with
probability min(1, p(x)/q(x)); at the first rejection the token comes from normalise(max(0, p-q));
when every draft is kept, a bonus token comes from p. The emitted tokens are then distributed
exactly as target-only sampling (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from engine.drafters import Proposal
from engine.request import Sequence
from engine.sampling import sample, target_probs


def verify(logits: Tensor, seqs: Seq[Sequence], proposals: Seq[Proposal]) -> list[list[int]]:
    """For each sequence, the drafts it keeps followed by the target's own token.

    `logits[i, j]` is the target's prediction after the pending token and the first j drafts.
    """
    greedy_rows = logits.argmax(dim=-1).tolist() if any(s.params.greedy for s in seqs) else None
    emitted = []
    for row, (seq, proposal) in enumerate(zip(seqs, proposals)):
        if seq.params.greedy:
            emitted.append(accept_greedy(greedy_rows[row], proposal.tokens))
        else:
            n = len(proposal.tokens)
            emitted.append(accept_sampled(target_probs(logits[row, : n + 1], seq.params), proposal, seq.generator))
    return emitted


def accept_greedy(target_argmax: list[int], drafts: list[int]) -> list[int]:
    kept = 0
    while kept < len(drafts) and drafts[kept] == target_argmax[kept]:
        kept += 1
    return drafts[:kept] + [target_argmax[kept]]


def accept_sampled(p: Tensor, proposal: Proposal, generator: torch.Generator | None) -> list[int]:
    """Rejection sampling of one chain; `p` is [len(drafts) + 1, V]."""
    out: list[int] = []
    for j, token in enumerate(proposal.tokens):
        q_token = 1.0 if proposal.probs is None else float(proposal.probs[j, token])
        p_token = float(p[j, token])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_token < p_token:  # u < p/q without dividing by a zero q
            out.append(token)
            continue
        if proposal.probs is None:
            residual = p[j].clone()
            residual[token] = 0.0
        else:
            residual = (p[j] - proposal.probs[j]).clamp_(min=0.0)
        mass = residual.sum()
        # p == q up to rounding: the rejection was a rounding artefact, so p itself is exact.
        out.append(sample(residual / mass if mass > 0 else p[j], generator))
        return out
    out.append(sample(p[len(proposal.tokens)], generator))
    return out
