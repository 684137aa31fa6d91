"""Turning logits into tokens: greedy, or sampling with temperature, top-k, top-p and a seed.

`target_probs` gives the exact distribution a request samples from; speculative verification
uses the same function, so speculation and target-only decoding sample from the same thing.

On an accelerator a batch is drawn on the device at once instead (`RowSampling`): each row's
parameters are tensors, `probs_by_row` is `target_probs` for every row with its own, and
`draw_by_row` inverts each row's cumulative sum at a uniform drawn before, from the row's own
generator (`uniforms`). Nothing reads a value back to the host, so a graph can capture them, and a
chain of sampled drafts or a batch of verifications costs one read back, not one a token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.native import forward as kernels


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities over the vocabulary ([..., V]) after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return nucleus(probs, params.top_p) if params.top_p < 1.0 else probs


# The nucleus is found by bucketing log-probabilities below each row's largest: 64 buckets a nat,
# 32 nats deep (a token further below holds under 1e-14 of its row's mass).
BUCKETS_PER_NAT = 64
BUCKETS = 32 * BUCKETS_PER_NAT


def nucleus(probs: Tensor, top_p: float) -> Tensor:
    """`probs` ([..., V]) kept on the smallest set of most likely tokens whose mass reaches top_p
    (the most likely always stays), renormalized.

    Sorting a vocabulary of 8192 costs about 360 us on a CPU, and at temperature 1 a nucleus often
    holds thousands of tokens. Instead each token goes to a bucket by how far below the row's
    largest it lies; the buckets above the one where the mass reaches top_p are kept whole, and
    only that bucket's tokens (a few dozen) are ranked. On a CPU the compiled kernels do it in one
    call (engine/native/forward.py `nucleus`); elsewhere, tensor operators (`nucleus_by_operators`)."""
    if probs.device.type == "cpu" and probs.dtype == torch.float32:
        kept = kernels.nucleus(probs, top_p)
        if kept is not None:
            return kept
    return nucleus_by_operators(probs, top_p)


def nucleus_by_operators(probs: Tensor, top_p: float) -> Tensor:
    """`nucleus` with tensor operators, on any device: buckets of log-probabilities, 64 a nat."""
    rows = probs.reshape(-1, probs.shape[-1])
    log = rows.log()
    depth = (log.max(dim=-1, keepdim=True).values - log).mul_(BUCKETS_PER_NAT)
    bucket = depth.clamp_(max=BUCKETS - 1).long()  # a zero probability (infinitely deep) goes last
    mass = torch.zeros(rows.shape[0], BUCKETS, dtype=rows.dtype, device=rows.device).scatter_add_(1, bucket, rows)
    below = mass.cumsum(dim=1) - mass  # the mass of every bucket above each bucket
    crossing = (below < top_p).sum(dim=1, keepdim=True) - 1  # the last bucket with less above it
    kept = torch.where(bucket < crossing, rows, 0.0)
    members = torch.where(bucket == crossing, rows, 0.0)
    width = max(int((members > 0).sum(dim=1).max()), 1)
    top, order = members.topk(width, dim=-1)
    before = below.gather(1, crossing) + top.cumsum(dim=-1) - top
    kept.scatter_add_(1, order, top.masked_fill(before >= top_p, 0.0))
    return (kept / kept.sum(dim=-1, keepdim=True)).reshape(probs.shape)


def sample(probs: Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from `probs` ([V]; any non-negative weights) by inverting their cumulative
    sum at one uniform draw. On CPU torch.multinomial took 140 us on an 8192-token row and this
    takes 12: sampled decoding draws a token per sequence at every draft step and every verify."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand(1, generator=generator, dtype=cdf.dtype, device=cdf.device)
    # The first token whose cumulative weight exceeds the draw: a zero-weight token never does.
    token = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if token >= len(cdf):  # the draw rounded up to the total: take the last token with weight
        token = int(probs.nonzero()[-1])
    return token


def next_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from the logits [V] of one sequence."""
    if params.greedy:
        return int(logits.argmax().item())
    return sample(target_probs(logits, params), generator)


@dataclass(frozen=True)
class RowSampling:
    """Each row's sampling parameters as device tensors [rows]."""

    temperature: Tensor  # float32, > 0
    top_k: Tensor  # int64, 0 keeps every token
    top_p: Tensor  # float32

    @classmethod
    def of(cls, params: Seq[SamplingParams], device: torch.device) -> RowSampling:
        """The parameters of sampled requests (temperature > 0), one row each."""
        return cls(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        )


def probs_by_row(logits: Tensor, rows: RowSampling) -> Tensor:
    """`target_probs` of logits [rows, ..., V], each row with its own parameters, with device
    operators only. The same distributions: top-k keeps every logit at or above the k-th largest
    and top-p the smallest set of most likely tokens whose mass reaches it, found here by sorting
    (the bucketed `nucleus` would read a count back to the host)."""
    shape = (-1,) + (1,) * (logits.dim() - 1)
    scaled = logits.float() / rows.temperature.view(shape)
    ordered = scaled.sort(dim=-1, descending=True).values
    vocab = logits.shape[-1]
    kth = (torch.where(rows.top_k > 0, rows.top_k.clamp(max=vocab), vocab) - 1).view(shape)
    cutoff = ordered.gather(-1, kth.expand(*ordered.shape[:-1], 1))
    probs = torch.softmax(scaled.masked_fill(scaled < cutoff, float("-inf")), dim=-1)
    ranked, order = probs.sort(dim=-1, descending=True)
    before = ranked.cumsum(dim=-1) - ranked  # the mass of every more likely token
    top_p = rows.top_p.view(shape)
    kept = torch.where((before < top_p) | (top_p >= 1.0), ranked, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, kept)
    return kept / kept.sum(dim=-1, keepdim=True)


def draw_by_row(probs: Tensor, u: Tensor) -> Tensor:
    """One token of each row of probs [rows, V] at its uniform u [rows] (float64), as `sample`
    draws it: the first token whose cumulative weight exceeds u times the row's total."""
    cdf = probs.double().cumsum(dim=-1)
    token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # A draw rounded up to the total takes the last token with weight, never one without.
    index = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, index, 0).amax(dim=-1)
    return torch.minimum(token, last)


def uniforms(generators: Seq[torch.Generator | None], count: int, device: torch.device) -> Tensor:
    """[rows, count] float64 uniforms, each row drawn from its own generator on the device."""
    return torch.stack([torch.rand(count, generator=g, dtype=torch.float64, device=device) for g in generators])


def draw_rows(
    logits: Tensor, params: Seq[SamplingParams], generators: Seq[torch.Generator | None]
) -> tuple[Tensor, Tensor]:
    """A token at every position of logits [rows, ..., V], row i drawn under params[i] from
    generators[i] (a draw a position, in order): the tokens [rows, ...] and the probabilities they
    were drawn from [rows, ..., V], with device operators only."""
    probs = probs_by_row(logits, RowSampling.of(params, logits.device))
    u = uniforms(generators, math.prod(probs.shape[1:-1]), logits.device)
    return draw_by_row(probs.reshape(-1, probs.shape[-1]), u.flatten()).view(probs.shape[:-1]), probs
