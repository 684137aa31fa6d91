"""A DFlash drafter's context and block forward through the compiled kernels."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import torch
from torch import Tensor

from engine.model.dflash import DFlashModel
from engine.model.kv_cache import KVCache
from engine.model.transformer import Transformer
from engine.native.abi import Context, Layer, Linear
from engine.native.weights import CacheStructs, Weights, int32_lists, model_struct, run_forward


class NativeDFlash:
    """A DFlash drafter's two calls through the compiled kernels: its context (fused taps to each
    draft layer's keys and values) and its block forward (non-causal within the block), with the
    target's embedding and LM head (the target's own `NativeForward`'s copies)."""

    def __init__(
        self, model: DFlashModel, target_model: Transformer, lib: ctypes.CDLL, positions: int, int8: bool = False
    ) -> None:
        config, target = model.config, target_model.native
        assert target is not None
        self.lib, self.config, self.target = lib, config, target  # the target's copies must outlive ours
        self.weights = weights = Weights(torch.int8 if int8 else model.fc.weight.dtype)
        layers = (Layer * config.num_layers)()
        kv = (Linear * config.num_layers)()
        for i, layer in enumerate(model.layers):
            layers[i] = Layer(
                weights.keep(layer.input_layernorm.weight),
                weights.linear(torch.cat((layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight))),
                weights.keep(layer.q_norm.weight),
                weights.keep(layer.k_norm.weight),
                weights.linear(layer.o_proj.weight),
                weights.keep(layer.post_attention_layernorm.weight),
                weights.gate_up(
                    torch.cat((layer.gate_proj.weight, layer.up_proj.weight)), None, config.intermediate_size
                ),
                weights.linear(layer.down_proj.weight),
            )
            kv[i] = weights.linear(torch.cat((layer.k_proj.weight, layer.v_proj.weight)))
        self._layers, self._kv = layers, kv
        cos, sin = model.rope(torch.arange(positions, device=model.fc.weight.device))
        # The target's LM head, or its rows of the draft vocabulary packed as our own.
        reduced = config.draft_vocab_size < config.vocab_size
        lm_head = weights.linear(model.head(target_model)) if reduced else target.model.lm_head
        self.model = model_struct(
            replace(config, vocab_size=config.draft_vocab_size),
            config.sliding_window or 0,
            target.model.embed,
            target.model.embed_bf16,
            target.model.embed_rows,
            weights.keep(model.norm.weight),
            weights.keep(cos[:, 0]),
            weights.keep(sin[:, 0]),
            lm_head,
            layers,
        )
        self.context_struct = Context(weights.linear(model.fc.weight), weights.keep(model.hidden_norm.weight), kv)
        self._cache = CacheStructs()

    def extend(self, cache: KVCache, slots: list[int], positions: list[int], taps: Tensor) -> None:
        """Token t of `taps` ([tokens, taps * hidden], float32) becomes context of `slots[t]` at `positions[t]`."""
        tokens = len(slots)
        taps = taps.contiguous()
        meta, per_token = int32_lists(slots, positions)
        failed = self.lib.adaspec_dflash_context(
            ctypes.byref(self.model),
            ctypes.byref(self.context_struct),
            ctypes.byref(self._cache(cache)),
            tokens,
            taps.data_ptr(),
            *per_token,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the compiled DFlash context could not allocate its activations")

    def block(self, cache: KVCache, slots: list[int], block: Tensor, drafts: int) -> Tensor:
        """Logits [rows, drafts, vocab] of block positions 1..drafts; block: int64 [rows, block size],
        placed after each slot's context (its keys and values are written past it and left unread)."""
        rows, size = block.shape
        block = block.contiguous()
        logits = torch.empty(rows, drafts, self.config.draft_vocab_size)
        meta = (slots, [cache.lengths[s] for s in slots], [size] * rows)
        run_forward(
            self.lib,
            self.model,
            self._cache(cache),
            (rows, size, block.data_ptr()),
            meta,
            logits,
            {},
            block=True,
            outputs=(1, drafts),
        )
        return logits
