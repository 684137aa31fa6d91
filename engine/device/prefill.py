"""Prompts prefilled through piecewise graphs: everything but attention captured, per token bucket.

A prefill's shape is its prompts' lengths, which never repeat, so a whole-forward graph would be
captured for nothing. Everything between two attentions, though, works on each token alone: the
norms, the projections, RoPE, the MLP. So the target's prefill runs on the batch's tokens laid end
to end, padded up to a bucket of the token ladder (`token_buckets`), and per bucket the work
between attentions is captured as one graph a piece:

    piece 0:      embed, RoPE's angles, layer 0 up to its rotated q, k, v
    piece i:      layer i-1 from its attention's output on (o_proj, residual, MLP, its tap) and
                  layer i up to its q, k, v
    piece L:      layer L-1 from its attention's output on, the final norm and the LM head of
                  each prompt's last token

while attention runs eagerly between pieces on the real tokens only, a prompt at a time: it writes
the cache and is the one step whose shape is the prompts'. Padding tokens run through the pieces and
are thrown away; they never reach the cache. Pieces read and write one set of static buffers,
sized for the largest bucket (a smaller bucket's graphs use their first rows), and never touch the
cache, so their warm-up runs are harmless.

Guards, each a reason counted when a prefill runs eagerly instead (`PrefillGraphs.fallbacks`): more
tokens than the largest bucket ("tokens"), more prompts than captured rows ("rows"), other
hidden-state taps than the graphs were captured with ("capture": an EAGLE-3 or DFlash drafter
needs the target's tapped layers at prefill), a prompt that would overflow its cache slot
("overflow": the eager forward raises the error). A prefill graph is keyed PREFILL and is never
selected for a verify (`select_graph` matches the mode exactly); the draft model's own prefill is
not captured. Off on CPU and NPU, for the reason each backend states (`Backend.prefill_graphs_off`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.device.backend import Backend, Graph
from engine.device.graphs import ForwardMode, GraphKey, copy_in, select_graph
from engine.model.kv_cache import KVCache
from engine.model.transformer import ForwardBatch, ForwardOutput, Transformer

SMALLEST_BUCKET = 16
# Default most tokens one prefill runs through graphs; a larger batch of prompts runs eagerly.
DEFAULT_MAX_TOKENS = 2048


def eager_prefill(backend: Backend, max_tokens: int, graphs_off: str | None = None) -> str | None:
    """Why prompts are prefilled eagerly rather than through these graphs, or None where they are
    not; `graphs_off` is the caller's reason for running no graphs at all, if it has one."""
    if max_tokens <= 0:
        return "prefill_graph_tokens = 0"
    if backend.prefill_graphs_off is not None:
        return backend.prefill_graphs_off
    if not backend.supports_graphs:
        return "no graphs on this device"
    return graphs_off


def token_buckets(max_tokens: int) -> list[int]:
    """16, 24, 32, 48, 64, 96, ... up to max_tokens, which is always one: each step is 1.5x or
    1.33x the one before, so a prefill pads at most a third of its tokens."""
    buckets, size = [], SMALLEST_BUCKET
    while size < max_tokens:
        buckets.append(size)
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return [*buckets, max_tokens]


@dataclass
class Buffers:
    """The static tensors every piece of every bucket reads and writes, at the largest bucket."""

    tokens: Tensor  # [T] int64, the prompts end to end, then padding
    positions: Tensor  # [T] int64
    last: Tensor  # [rows] int64, each prompt's last token among the T
    x: Tensor  # [T, hidden], the residual stream
    cos: Tensor  # [T, 1, head_dim]
    sin: Tensor
    q: Tensor  # [T, heads, head_dim], the current layer's, rotated
    k: Tensor  # [T, kv_heads, head_dim]
    v: Tensor
    attended: Tensor  # [T, heads * head_dim], the current layer's attention output
    taps: dict[int, Tensor]  # layer -> [T, hidden], its output
    logits: Tensor  # [rows, vocab], each prompt's last token


class PrefillGraphs:
    """The target's prefill through piecewise graphs (see the module's doc), one set of pieces per
    token bucket, all captured once at start-up with the hidden-state taps `capture`."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        backend: Backend,
        max_tokens: int,
        max_rows: int,
        capture: Seq[int] = (),
    ) -> None:
        if model.native is not None:
            raise ValueError("prefill graphs capture the PyTorch forward; this model runs the compiled CPU one")
        if backend.prefill_graphs_off is not None:
            raise ValueError(f"no prefill graphs: {backend.prefill_graphs_off}")
        self.model, self.cache, self.backend = model, cache, backend
        self.capture = tuple(capture)
        self.buckets = token_buckets(max_tokens)
        self.max_rows = max_rows
        self.buffers = self._buffers(self.buckets[-1], max_rows)
        self.keys = [GraphKey(ForwardMode.PREFILL, size, max_rows, self.capture) for size in self.buckets]
        self.pieces: dict[GraphKey, list[Graph]] = {}
        self.fallbacks: Counter[str] = Counter()  # reason -> prefills run eagerly for it
        self.replays = 0  # prefills run through graphs
        backend.empty_cache()
        before = backend.memory_reserved()
        started = time.perf_counter()
        with torch.inference_mode():
            for key in reversed(self.keys):  # largest first, as GraphRunner: smaller ones reuse its blocks
                self.pieces[key] = [backend.capture(body)[0] for body in self._bodies(key.width)]
        backend.synchronize()
        self.seconds = time.perf_counter() - started
        self.memory_bytes = max(0, backend.memory_reserved() - before)

    @property
    def captures(self) -> int:
        return sum(len(pieces) for pieces in self.pieces.values())

    def _buffers(self, size: int, rows: int) -> Buffers:
        config, device = self.model.config, self.model.device
        dtype = self.model.norm.weight.dtype
        attention = self.model.layers[0].self_attn

        def new(*shape: int, dtype: torch.dtype = dtype) -> Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return Buffers(
            tokens=new(size, dtype=torch.long),
            positions=new(size, dtype=torch.long),
            last=new(rows, dtype=torch.long),
            x=new(size, config.hidden_size),
            cos=new(size, 1, config.head_dim),
            sin=new(size, 1, config.head_dim),
            q=new(size, attention.num_heads, config.head_dim),
            k=new(size, attention.num_kv_heads, config.head_dim),
            v=new(size, attention.num_kv_heads, config.head_dim),
            attended=new(size, attention.q_size),
            taps={layer: new(size, config.hidden_size) for layer in self.capture},
            logits=new(rows, config.vocab_size),
        )

    def _bodies(self, size: int) -> list[Callable[[], tuple[()]]]:
        """The pieces of one bucket, in the order they run (see the module's doc)."""
        model, buf, layers = self.model, self.buffers, len(self.model.layers)

        def project(layer: int) -> None:  # layer's input (x) -> its rotated q, k, v
            block = model.layers[layer]
            q, k, v = block.self_attn.rotate(block.self_attn.qkv(block.input_layernorm(buf.x[:size])), cos, sin)
            buf.q[:size].copy_(q)
            buf.k[:size].copy_(k)
            buf.v[:size].copy_(v)

        def finish(layer: int) -> None:  # layer's attention output -> its output (x), as Block.forward
            block = model.layers[layer]
            x = buf.x[:size] + block.self_attn.o_proj(buf.attended[:size])
            x = x + block.mlp(block.post_attention_layernorm(x))
            buf.x[:size].copy_(x)
            if layer in buf.taps:
                buf.taps[layer][:size].copy_(x)

        cos, sin = buf.cos[:size], buf.sin[:size]

        def first() -> tuple[()]:
            positions = buf.positions[:size]
            buf.x[:size].copy_(model.embed_tokens(buf.tokens[:size]))
            cos.copy_(model.rope_cos[positions].to(cos.dtype).unsqueeze(-2))
            sin.copy_(model.rope_sin[positions].to(sin.dtype).unsqueeze(-2))
            project(0)
            return ()

        def between(layer: int) -> Callable[[], tuple[()]]:
            def body() -> tuple[()]:
                finish(layer - 1)
                project(layer)
                return ()

            return body

        def last() -> tuple[()]:
            finish(layers - 1)
            buf.logits.copy_(model.lm_head(model.norm(buf.x[:size].index_select(0, buf.last))))
            return ()

        return [first, *(between(layer) for layer in range(1, layers)), last]

    def refusal(self, slots: Seq[int], new_tokens: Seq[Seq[int]], capture: Seq[int]) -> str | None:
        """Why this prefill cannot run through the graphs (a guard's reason), or None."""
        if tuple(capture) != self.capture:
            return "capture"
        if len(slots) > self.max_rows:
            return "rows"
        if sum(len(tokens) for tokens in new_tokens) > self.buckets[-1]:
            return "tokens"
        if any(
            not tokens or self.cache.lengths[s] + len(tokens) > self.cache.max_seq_len
            for s, tokens in zip(slots, new_tokens)
        ):
            return "overflow"
        return None

    def run(self, slots: Seq[int], new_tokens: Seq[Seq[int]], capture: Seq[int] = ()) -> ForwardOutput | None:
        """Prefill `new_tokens[i]` into cache slot `slots[i]`: each prompt's last-token logits
        ([rows, 1, vocab]) and the taps as the eager forward lays them out ([rows, longest, hidden]);
        None, with the reason counted, when a guard refuses (the caller runs eagerly)."""
        reason = self.refusal(slots, new_tokens, capture)
        if reason is not None:
            self.fallbacks[reason] += 1
            return None
        total = sum(len(tokens) for tokens in new_tokens)
        key = select_graph(self.keys, ForwardMode.PREFILL, total, self.max_rows, self.capture)
        assert key is not None  # the guards above leave a bucket
        size, buf = key.width, self.buffers
        # Rows attend one at a time on the real tokens: the batch says where each token goes.
        batch = ForwardBatch.build(self.cache, slots, new_tokens, self.model.config.sliding_window, by_row=True)
        assert batch.rows is not None
        padding = [0] * (size - total)
        flat = [t for tokens in new_tokens for t in tokens]
        positions = [row.kv_len - row.count + j for row in batch.rows for j in range(row.count)]
        copy_in(buf.tokens[:size], torch.tensor(flat + padding, dtype=torch.long))
        copy_in(buf.positions[:size], torch.tensor(positions + padding, dtype=torch.long))
        ends = [row.first + row.count - 1 for row in batch.rows]
        copy_in(buf.last, torch.tensor(ends + [0] * (self.max_rows - len(ends)), dtype=torch.long))
        pieces = self.pieces[key]
        with torch.inference_mode():
            for layer, piece in enumerate(pieces[:-1]):
                piece.replay()
                attention = self.model.layers[layer].self_attn
                out = attention.attend_by_row(buf.q[:total], buf.k[:total], buf.v[:total], batch, self.cache)
                buf.attended[:total].copy_(out)
            pieces[-1].replay()
            # New tensors, not views of the buffers: the next prefill overwrites those.
            hidden = {layer: batch.unpack(tap[:total]) for layer, tap in buf.taps.items()}
            logits = buf.logits[: len(slots), None].clone()
        for slot, tokens in zip(slots, new_tokens):
            self.cache.lengths[slot] += len(tokens)
        self.replays += 1
        return ForwardOutput(logits=logits, hidden=hidden)
