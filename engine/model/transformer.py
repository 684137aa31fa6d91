"""One decoder for the Llama, Mistral, Qwen2 and Qwen3 families, in plain PyTorch.

The forward takes a ragged batch: each sequence brings any number of new tokens (a prompt, one
decode token, or the k+1 tokens of a speculative verify), appends their keys and values to its own
cache slot, and attends to everything before them. Projections are fused (qkv, gate+up) because
on small models the cost per token is dominated by the number of kernels, not their size.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.config import ModelConfig, RopeConfig
from engine.model.kv_cache import KVCache
from engine.model.layers import DerivedCopy, Embedding, Linear


@dataclass
class AttentionRow:
    """One sequence of a batch whose rows attend one at a time (`ForwardBatch.rows`)."""

    slot: int
    first: int  # where its new tokens start among the packed tokens
    count: int  # how many new tokens it has
    kv_len: int  # cache positions it reads: everything up to its last new token
    mask: Tensor | None  # [count, kv_len], True where a key is visible; None when all are


# What attending to a row on its own costs beyond its query-key pairs (a call and two cache views),
# in query-key pairs: about 15 us on the CPU the benchmarks run on, where a pair costs 0.013 us.
ROW_OVERHEAD_PAIRS = 1200

# Packing a padded batch to its real tokens costs a gather and a scatter around each layer's
# attention and a scatter of the logits: about 0.15 ms a verify of 4 rows of 4 to 6 tokens on the
# CPU the benchmarks run on, as much as running 2 or 3 padding tokens through the layers. A batch
# with less padding than this runs padded, its padding computed and thrown away.
PACK_MIN_PADDING = 3


def check_fits(cache: KVCache, slots: Sequence[int], num_new: Sequence[int]) -> list[int]:
    """Each slot's cached length, once every row brings a token and fits in the cache."""
    starts = [cache.lengths[s] for s in slots]
    for slot, start, n in zip(slots, starts, num_new):
        if n == 0:
            raise ValueError(f"slot {slot}: a forward needs at least one new token")
        if start + n > cache.max_seq_len:
            raise ValueError(f"slot {slot}: {start} + {n} tokens exceed max_seq_len {cache.max_seq_len}")
    return starts


@dataclass
class TokenBatch:
    """Each row's new tokens and its cache slot, and nothing derived from them: all the compiled
    CPU forward reads (engine/native/forward.py), built for a few microseconds where a `ForwardBatch`
    takes tens. `Transformer.batch` gives one to a compiled model."""

    slots: list[int]
    new_tokens: Sequence[Sequence[int]]

    @classmethod
    def build(cls, cache: KVCache, slots: Sequence[int], new_tokens: Sequence[Sequence[int]]) -> TokenBatch:
        check_fits(cache, slots, [len(t) for t in new_tokens])
        return cls(list(slots), new_tokens)


@dataclass
class ForwardBatch:
    """Where each new token goes: built on the host once per forward by `ForwardBatch.build`."""

    tokens: Tensor  # [B, T] new tokens, right-padded
    # positions and write_pos are [real tokens] instead of [B, T] when the rows attend one at a time.
    positions: Tensor  # [B, T] absolute position of each token (RoPE and the causal mask)
    write_pos: Tensor  # [B, T] cache position each token is written to; padding -> scratch row
    slots: Tensor  # [B] cache slot of each sequence
    slot_start: int | None  # slots are slot_start, slot_start+1, ...: the cache is read as a view
    num_new: list[int]  # real (unpadded) new tokens per sequence
    kv_len: int  # how many cache positions attention reads
    mask: Tensor | None  # [B, 1, T, kv_len], True where a key is visible; None when all are
    # Where the real tokens lie among the B * T padded ones, when rows are shorter by at least
    # PACK_MIN_PADDING tokens in all: the layers then run on the real tokens alone and only
    # attention sees the padded layout. On a CPU a row of a matrix product costs about as much as
    # a short token of attention does not. None: every position runs (padding gives junk logits).
    real: Tensor | None = None
    # On a CPU attention costs about its query-key pairs, and a padded batch scores its padding
    # too: a verify of one 13-token chain beside three of 4 scored twice the pairs it needed. When
    # attending row by row is estimated cheaper, each row attends on its own (`rows`) and every
    # per-token tensor is packed to the real tokens (`token_slots`, `write_pos`, `positions`).
    rows: list[AttentionRow] | None = None
    token_slots: Tensor | None = None  # [real tokens] cache slot of each token, with `rows`

    def pack(self, x: Tensor) -> Tensor:
        """[B, T, ...] padded -> [real tokens, ...]; unchanged when no row is padded."""
        if self.real is None:
            return x
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.real)

    def unpack(self, x: Tensor) -> Tensor:
        """[real tokens, ...] -> [B, T, ...], zeros where a row is padded; the inverse of `pack`."""
        if self.real is None:
            return x
        bsz, width = self.tokens.shape
        padded = x.new_zeros(bsz * width, *x.shape[1:]).index_copy_(0, self.real, x)
        return padded.view(bsz, width, *x.shape[1:])

    @property
    def slot_list(self) -> list[int]:
        if self.slot_start is not None:  # no device read-back on the common path
            return list(range(self.slot_start, self.slot_start + len(self.num_new)))
        return self.slots.tolist()

    @classmethod
    def build(
        cls,
        cache: KVCache,
        slots: Sequence[int],
        new_tokens: Sequence[Sequence[int]],
        sliding_window: int | None = None,
        by_row: bool | None = None,
    ) -> ForwardBatch:
        """The batch that appends `new_tokens[i]` to cache slot `slots[i]`. Its rows attend one at
        a time when `by_row` says so or, left None, where that is estimated cheaper than attending
        padded (on a CPU only: an accelerator runs the padded batch as one launch)."""
        device = cache.k.device
        num_new = [len(t) for t in new_tokens]
        width = max(num_new)
        starts = check_fits(cache, slots, num_new)
        # Built as host lists and turned into one tensor each: a decode step's batch is a few
        # numbers, and every tensor op spent on it costs about a microsecond.
        kv_len = max(s + n for s, n in zip(starts, num_new))
        padding = len(slots) * width - sum(num_new)
        if by_row is None:
            by_row = padding > 0 and device.type == "cpu" and cls._rows_cheaper(starts, num_new, kv_len)
        packed = by_row or padding >= PACK_MIN_PADDING
        real = [row * width + j for row, n in enumerate(num_new) for j in range(n)] if packed else None
        tokens = torch.tensor([[*t, *[0] * (width - len(t))] for t in new_tokens], dtype=torch.long, device=device)
        slot_tensor = torch.tensor(list(slots), dtype=torch.long, device=device)
        slot_start = slots[0] if list(slots) == list(range(slots[0], slots[0] + len(slots))) else None
        rows = token_slots = mask = None
        if by_row:
            # Nothing is padded, so each token is written where it sits: one tensor serves both.
            positions = write_pos = torch.tensor(
                [s + j for s, n in zip(starts, num_new) for j in range(n)], dtype=torch.long, device=device
            )
            rows = cls._rows(slots, starts, num_new, sliding_window, device)
            token_slots = torch.tensor([s for s, n in zip(slots, num_new) for _ in range(n)], device=device)
        else:
            padded_positions = [[start + j for j in range(width)] for start in starts]
            ragged = width > 1 or any(s + n != kv_len for s, n in zip(starts, num_new))
            if ragged or (sliding_window is not None and kv_len > sliding_window):
                query_pos = torch.tensor(padded_positions, dtype=torch.long)[:, :, None]
                mask = visible_keys(query_pos, torch.arange(kv_len)[None, None, :], sliding_window)[:, None].to(device)
            last = cache.max_seq_len - 1
            positions = torch.tensor(
                [[min(p, last) for p in row] for row in padded_positions], dtype=torch.long, device=device
            )
            write_pos = torch.tensor(
                [
                    [p if j < n else cache.scratch_pos for j, p in enumerate(row)]
                    for row, n in zip(padded_positions, num_new)
                ],
                dtype=torch.long,
                device=device,
            )
        return cls(
            tokens=tokens,
            positions=positions,
            write_pos=write_pos,
            slots=slot_tensor,
            slot_start=slot_start,
            num_new=num_new,
            kv_len=kv_len,
            mask=mask,
            real=torch.tensor(real, dtype=torch.long, device=device) if real is not None else None,
            rows=rows,
            token_slots=token_slots,
        )

    @staticmethod
    def _rows_cheaper(starts: Sequence[int], num_new: Sequence[int], kv_len: int) -> bool:
        padded_pairs = len(num_new) * max(num_new) * kv_len
        return sum(n * (s + n) + ROW_OVERHEAD_PAIRS for s, n in zip(starts, num_new)) < padded_pairs

    @staticmethod
    def _rows(
        slots: Sequence[int],
        starts: Sequence[int],
        num_new: Sequence[int],
        sliding_window: int | None,
        device: torch.device,
    ) -> list[AttentionRow]:
        rows, first = [], 0
        for slot, start, n in zip(slots, starts, num_new):
            mask = None
            if n > 1 or (sliding_window is not None and start + n > sliding_window):
                query = torch.arange(start, start + n)[:, None]
                mask = visible_keys(query, torch.arange(start + n)[None, :], sliding_window).to(device)
            rows.append(AttentionRow(slot, first, n, start + n, mask))
            first += n
        return rows


# What a forward takes: the compiled one reads either, PyTorch operators a ForwardBatch.
Batch = TokenBatch | ForwardBatch


def visible_keys(query_pos: Tensor, key_pos: Tensor, sliding_window: int | None) -> Tensor:
    """Which keys each query sees: those at or before it, within the sliding window if any."""
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    return visible


@dataclass
class ForwardOutput:
    logits: Tensor  # [B, T, V], or [B, 1, V] with last_only
    hidden: dict[int, Tensor]  # layer index -> that layer's output [B, T, D]
    argmax: Tensor | None = None  # logits.argmax(-1) where the forward computed it (the compiled kernels)


class Captured(dict):
    """Captured hidden states written side by side in one tensor, `joined` ([B, T, layers * D],
    in the order of `layers`, repeats dropped), each layer's entry a view of it: a drafter that
    fuses the layers (`side_by_side`) then reads them without a copy."""

    def __init__(self, joined: Tensor, layers: Sequence[int]) -> None:
        self.layers = tuple(dict.fromkeys(layers))
        width = joined.shape[-1] // len(self.layers)
        super().__init__({layer: joined[..., i * width : (i + 1) * width] for i, layer in enumerate(self.layers)})
        self.joined = joined

    def rows(self, index: Tensor) -> Captured:
        return Captured(self.joined.index_select(0, index), self.layers)


def side_by_side(hidden: dict[int, Tensor], layers: Sequence[int]) -> Tensor:
    """The hidden states of `layers` concatenated on their last dimension: the forward's own tensor
    where it wrote them so (`Captured`, on the compiled kernels, whose outputs are new each call),
    otherwise a copy (a graph's outputs are overwritten by its next replay)."""
    if isinstance(hidden, Captured) and hidden.layers == tuple(layers):
        return hidden.joined
    return torch.cat([hidden[i] for i in layers], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # one fused kernel; the same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """RoPE's cos and signed sin at any positions, for the drafters that rotate keys at arbitrary
    positions. The angles are computed in float32 whatever dtype the module is cast to: in
    bfloat16, position x frequency is off by whole radians past a few hundred positions."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inverse_frequencies(rope, head_dim), persistent=False)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Rotary:
        exact = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = exact.to(self.inv_freq.device)  # moved with the module, never rounded
        return self

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and signed sin [..., 1, D] in `dtype` for `positions` (any shape): a heads axis
        before the last, the rotate_half of `apply_rope` folded into the sign."""
        angles = positions.float()[..., None] * self.inv_freq
        cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
        sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)
        return cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half's negation folded into `signed_sin`."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.output_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch | None, cache: KVCache | None) -> Tensor:
        qkv = self.qkv(x)
        if batch is not None and batch.rows is None:
            qkv = batch.unpack(qkv)
        q, k, v = self.rotate(qkv, cos, sin)
        if batch is not None and cache is not None and batch.rows is not None:
            return self.o_proj(self.attend_by_row(q, k, v, batch, cache))
        bsz, seqlen = qkv.shape[:2]
        if batch is None or cache is None:  # training: plain causal attention over x
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
        else:
            k_cache, v_cache = cache.k[self.layer], cache.v[self.layer]
            rows = batch.slots[:, None].expand(bsz, seqlen)
            k_cache.index_put_((rows, batch.write_pos), k)
            v_cache.index_put_((rows, batch.write_pos), v)
            if batch.slot_start is not None:
                keys = k_cache[batch.slot_start : batch.slot_start + bsz, : batch.kv_len]
                values = v_cache[batch.slot_start : batch.slot_start + bsz, : batch.kv_len]
            else:
                keys = k_cache[batch.slots, : batch.kv_len]
                values = v_cache[batch.slots, : batch.kv_len]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=batch.mask,
                enable_gqa=True,
            )
        out = out.transpose(1, 2).reshape(bsz, seqlen, self.q_size)
        return self.o_proj(batch.pack(out) if batch is not None else out)

    def rotate(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The queries, keys and values of the qkv projection [..., q_size + 2 * kv_size], as
        [..., heads, D] each ([B, T, ...], or [tokens, ...] when the rows attend one at a time),
        queries and keys normed (where the family does) and rotated to their positions."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = qkv.view(*qkv.shape[:-1], heads + 2 * kv_heads, self.head_dim)
        v = qkv[..., heads + kv_heads :, :]
        if self.q_norm is not None and self.k_norm is not None:
            q_heads, k_heads = qkv[..., :heads, :], qkv[..., heads : heads + kv_heads, :]
            qk = torch.cat((self.q_norm(q_heads), self.k_norm(k_heads)), dim=-2)
        else:
            qk = qkv[..., : heads + kv_heads, :]
        # Queries and keys get the same rotation: one pass over both heads' worth of values.
        q, k = apply_rope(qk, cos, sin).split([heads, kv_heads], dim=-2)
        return q, k, v

    def attend_by_row(self, q: Tensor, k: Tensor, v: Tensor, batch: ForwardBatch, cache: KVCache) -> Tensor:
        """Attention for packed tokens ([tokens, heads, D]), a row at a time; [tokens, q_size]."""
        assert batch.rows is not None and batch.token_slots is not None
        k_cache, v_cache = cache.k[self.layer], cache.v[self.layer]
        k_cache.index_put_((batch.token_slots, batch.write_pos), k)
        v_cache.index_put_((batch.token_slots, batch.write_pos), v)
        outs = []
        for row in batch.rows:
            query = q[row.first : row.first + row.count].transpose(0, 1)[None]
            keys = k_cache[row.slot : row.slot + 1, : row.kv_len].transpose(1, 2)
            values = v_cache[row.slot : row.slot + 1, : row.kv_len].transpose(1, 2)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=row.mask, enable_gqa=True)
            outs.append(out[0].transpose(0, 1).reshape(row.count, self.q_size))
        return torch.cat(outs)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch | None, cache: KVCache | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class CompiledForward(Protocol):
    """A forward that replaces the operators' one (engine/native/forward.py `NativeForward`)."""

    def __call__(self, batch: Batch, cache: KVCache, last_only: bool, capture: tuple[int, ...]) -> ForwardOutput: ...


class Transformer(DerivedCopy, nn.Module):
    derived = ("native",)  # the compiled forward holds copies and addresses of the parameters

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_positions = max_positions or config.max_position_embeddings
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if self.embed_tokens.weight.device.type != "meta":  # built once the weights are in place
            self.build_rope()
        # The compiled CPU forward (engine/native/), set by the loader where the kernels serve this
        # model (engine/checkpoint.py `use_native`); dropped when the parameters move or are loaded.
        self.native: CompiledForward | None = None

    @property
    def device(self) -> torch.device:
        """Where the model runs (its final norm's device: never quantized, so never on meta)."""
        return self.norm.weight.device

    def build_rope(self) -> None:
        device = self.device
        positions = torch.arange(self.max_positions, device=device).float()
        inv_freq = rope_inverse_frequencies(self.config.rope, self.config.head_dim).to(device)
        angles = torch.outer(positions, inv_freq)
        self.rope_cos = angles.cos().repeat(1, 2)
        self.rope_sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)  # see apply_rope

    def batch(self, cache: KVCache, slots: Sequence[int], new_tokens: Sequence[Sequence[int]]) -> Batch:
        """The batch appending `new_tokens[i]` to cache slot `slots[i]`, as this model's forward reads it."""
        if self.native is not None:
            return TokenBatch.build(cache, slots, new_tokens)
        return ForwardBatch.build(cache, slots, new_tokens, self.config.sliding_window)

    def forward(
        self,
        batch: Batch,
        cache: KVCache,
        last_only: bool = False,
        capture: Sequence[int] = (),
    ) -> ForwardOutput:
        """Run the new tokens of `batch`, appending them to `cache`, and return their logits."""
        if self.native is not None:
            return self.native(batch, cache, last_only, tuple(capture))
        if isinstance(batch, TokenBatch):
            batch = ForwardBatch.build(cache, batch.slots, batch.new_tokens, self.config.sliding_window)
        x, hidden = self.run_layers(batch, cache, capture)
        if last_only and batch.real is not None:  # x is packed: each sequence's last real token
            last = torch.tensor(list(itertools.accumulate(batch.num_new)), device=x.device) - 1
            x = x[last][:, None]
        elif last_only and x.shape[1] > 1:
            last = torch.tensor([n - 1 for n in batch.num_new], device=x.device)
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        for slot, n in zip(batch.slot_list, batch.num_new):
            cache.lengths[slot] += n
        logits = self.lm_head(self.norm(x))
        return ForwardOutput(logits=logits if last_only else batch.unpack(logits), hidden=hidden)

    def run_layers(
        self, batch: ForwardBatch, cache: KVCache, capture: Sequence[int] = ()
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Embed and run every layer, writing the new keys and values into `cache`.

        Nothing here reads a device value back to the host, so a graph can capture it
        (engine/device/graphs.py); the host-side lengths are left to the caller. Returns x packed to
        the real tokens when the batch is packed (`ForwardBatch.real`), else [B, T, D].
        """
        x = batch.pack(self.embed_tokens(batch.tokens))
        dtype = x.dtype
        # [B, T, 1, D], or [tokens, 1, D] when the positions are packed (`ForwardBatch.rows`).
        cos = self.rope_cos[batch.positions].to(dtype).unsqueeze(-2)
        sin = self.rope_sin[batch.positions].to(dtype).unsqueeze(-2)
        hidden: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch, cache)
            if i in capture:
                hidden[i] = batch.unpack(x)
        return x, hidden

    def forward_train(self, tokens: Tensor, capture: Sequence[int] = ()) -> Tensor:
        """Causal forward over whole sequences without a cache; returns logits [B, T, V]."""
        logits, _ = self.train_layers(tokens, capture)
        assert logits is not None
        return logits

    def train_layers(
        self, tokens: Tensor, capture: Sequence[int] = (), logits: bool = True
    ) -> tuple[Tensor | None, dict[int, Tensor]]:
        """As `forward_train`, with the outputs of the layers in `capture` ([B, T, D] each). With
        `logits=False` the forward stops at the last captured layer and returns no logits."""
        x = self.embed_tokens(tokens)
        seqlen = tokens.shape[1]
        cos = self.rope_cos[:seqlen].to(x.dtype)[None, :, None]
        sin = self.rope_sin[:seqlen].to(x.dtype)[None, :, None]
        hidden: dict[int, Tensor] = {}
        layers = self.layers if logits else self.layers[: max(capture) + 1]
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, None, None)
            if i in capture:
                hidden[i] = x
        return (self.lm_head(self.norm(x)) if logits else None), hidden

    def pack_linears(self) -> None:
        """Pack every linear weight for oneDNN (see `Linear`); for inference, after loading."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def new_cache(self, max_batch_size: int, max_seq_len: int) -> KVCache:
        if max_seq_len > self.rope_cos.shape[0]:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's {self.rope_cos.shape[0]} positions")
        return KVCache(
            self.config.num_layers,
            max_batch_size,
            max_seq_len,
            self.config.num_kv_heads,
            self.config.head_dim,
            dtype=torch.float32 if self.native is not None else self.norm.weight.dtype,  # the kernels' activations
            device=self.device,
            transposed_keys=self.native is not None,
        )
