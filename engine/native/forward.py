"""The target's forward through the compiled kernels, and their top-p filter."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from engine.model.kv_cache import KVCache
from engine.model.transformer import Batch, Captured, ForwardOutput, TokenBatch, Transformer
from engine.native.abi import Layer
from engine.native.build import library
from engine.native.weights import CacheStructs, Weights, int32_lists, model_struct, padded_tokens, run_forward


class NativeForward:
    """`Transformer.forward` for a float32 or bfloat16 model on a CPU, through the compiled kernels.

    Holds panel copies of the model's linear weights (a layer's groups where it is quantized,
    engine/model/quantize.py; else in the model's dtype, or as `linears` says: int8 for a drafter,
    whose precision moves only how many drafts are kept) and the addresses of
    its other parameters (float32 copies of a bfloat16 model's small ones: activations are float32
    either way, and stored weights are widened as they are read): the model drops it when its
    parameters move or are loaded (`Transformer._apply`). Layers already packed
    (engine/native/weights.py `GroupPanels`) are pointed to, not copied; an embedding kept only so
    is read from its panels, or from the lm head's where the two are tied.

    `weight_bytes` counts what it streams and points to."""

    def __init__(self, model: Transformer, lib: ctypes.CDLL, linears: torch.dtype | None = None) -> None:
        config = model.config
        self.lib = lib
        self.config = config
        embed_dtype = model.embed_tokens.weight.dtype
        self.weights = weights = Weights(linears or embed_dtype)
        layers = (Layer * config.num_layers)()
        for i, block in enumerate(model.layers):
            attention, mlp = block.self_attn, block.mlp
            layers[i] = Layer(
                weights.keep(block.input_layernorm.weight),
                weights.linear(attention.qkv.weight, attention.qkv.bias, attention.qkv.quantized),
                weights.keep(attention.q_norm.weight if attention.q_norm is not None else None),
                weights.keep(attention.k_norm.weight if attention.k_norm is not None else None),
                weights.linear(attention.o_proj.weight, attention.o_proj.bias, attention.o_proj.quantized),
                weights.keep(block.post_attention_layernorm.weight),
                weights.gate_up(mlp.gate_up.weight, mlp.gate_up.bias, config.intermediate_size, mlp.gate_up.quantized),
                weights.linear(mlp.down_proj.weight, mlp.down_proj.bias, mlp.down_proj.quantized),
            )
        self._layers = layers
        lm_head = weights.linear(model.lm_head.weight, model.lm_head.bias, model.lm_head.quantized)
        embed, rows = model.embed_tokens, None
        if embed.weight.is_meta:  # kept only in panels: its rows are read from them
            tied = embed.weight is model.lm_head.weight
            self._embed_rows = lm_head if tied else weights.linear(embed.weight, None, embed.quantized)
            rows = ctypes.pointer(self._embed_rows)
        self.model = model_struct(
            config,
            config.sliding_window or 0,
            None if rows else weights.keep(embed.weight, embed_dtype),
            int(embed_dtype == torch.bfloat16),
            rows,
            weights.keep(model.norm.weight),
            weights.keep(model.rope_cos),
            weights.keep(model.rope_sin),
            lm_head,
            layers,
        )
        self._cache = CacheStructs()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the kernels read (their panels, scales and small parameters)."""
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in self.weights.kept}
        return sum(seen.values())

    def __call__(
        self, batch: Batch, cache: KVCache, last_only: bool = False, capture: tuple[int, ...] | list[int] = ()
    ) -> ForwardOutput:
        if isinstance(batch, TokenBatch):
            slots, counts = batch.slots, [len(t) for t in batch.new_tokens]
            rows, width = len(slots), max(counts)
            tokens: ctypes.Array | Tensor = padded_tokens(batch.new_tokens, width)  # held until the call returns
            tokens_address = ctypes.addressof(tokens)
        else:
            slots, counts = batch.slot_list, batch.num_new
            rows, width = batch.tokens.shape
            tokens = batch.tokens.contiguous()
            tokens_address = tokens.data_ptr()
        ragged = any(n != width for n in counts)
        new = torch.zeros if ragged else torch.empty  # padded places stay zero, as the PyTorch path leaves them
        vocab, hidden_size = self.config.vocab_size, self.config.hidden_size
        logits = torch.empty(rows, 1, vocab) if last_only else new(rows, width, vocab)
        argmax = torch.zeros(logits.shape[:-1], dtype=torch.long)  # a padded place's zero logits: 0
        hidden = Captured(new(rows, width, len(set(capture)) * hidden_size), capture) if capture else {}
        starts = [cache.lengths[s] for s in slots]
        run_forward(
            self.lib,
            self.model,
            self._cache(cache),
            (rows, width, tokens_address),
            (slots, starts, counts),
            logits,
            hidden,
            last_only,
            argmax=argmax,
        )
        for slot, n in zip(slots, counts):
            cache.lengths[slot] += n
        return ForwardOutput(logits=logits, hidden=hidden, argmax=argmax)

    def greedy_chain(
        self, cache: KVCache, slots: list[int], inputs: list[list[int]], drafts: list[int]
    ) -> list[list[int]]:
        """Greedy chains in one call: each row feeds `inputs[r]` (what its cache lacks), then its
        drafts but the last, one forward a step, until it has `drafts[r]` (each >= 1). Each row's
        drafts; the caches then hold all the row fed."""
        rows, width = len(slots), max(len(t) for t in inputs)
        tokens = padded_tokens(inputs, width)
        starts = [cache.lengths[s] for s in slots]
        meta, per_row = int32_lists(slots, starts, [len(t) for t in inputs], drafts)
        out = torch.zeros(rows, max(drafts), dtype=torch.long)
        failed = self.lib.adaspec_greedy_chain(
            ctypes.byref(self.model),
            ctypes.byref(self._cache(cache)),
            rows,
            width,
            ctypes.addressof(tokens),
            *per_row,
            out.data_ptr(),
            out.shape[1],
            torch.get_num_threads(),
        )
        if failed == -2:
            raise ValueError("a greedy chain needs every row to feed at least one token and draft at least one")
        if failed:
            raise MemoryError("the compiled greedy chain could not allocate its activations")
        for slot, fed, n in zip(slots, inputs, drafts):
            cache.lengths[slot] += len(fed) + n - 1
        return [row[:n] for row, n in zip(out.tolist(), drafts)]


def nucleus(probs: Tensor, top_p: float) -> Tensor | None:
    """engine.sampling's top-p filter of float32 rows on a CPU in the kernels (about 7 times
    faster than its tensor operators on an 8192-token row, bench.sampling); None where they are
    not built."""
    lib = library()
    if lib is None:
        return None
    rows = probs.reshape(-1, probs.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    if lib.adaspec_nucleus(rows.data_ptr(), rows.shape[0], rows.shape[1], top_p, out.data_ptr()):
        raise MemoryError("the compiled top-p filter could not allocate its buckets")
    return out.reshape(probs.shape)
