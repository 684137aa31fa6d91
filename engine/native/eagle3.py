"""An EAGLE-3 head's step, chains and whole greedy round through the compiled kernels."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from engine.model.eagle3 import Eagle3Model
from engine.model.kv_cache import KVCache
from engine.native.abi import Layer, Model
from engine.native.forward import NativeForward
from engine.native.weights import CacheStructs, Weights, int32_lists


class Sampling(NamedTuple):
    """How a compiled chain draws its drafts, row by row: 1 / temperature and top_p [rows]
    (float32), a uniform draw per draft [rows, width] (float64), and where each draft's
    probabilities go [rows, width, vocab] (float32, contiguous)."""

    inv_temperature: Tensor
    top_p: Tensor
    uniforms: Tensor
    probs: Tensor


class NativeEagle3:
    """An EAGLE-3 head's step through the compiled kernels: its linear weights packed as the
    target's are, the target's embedding shared."""

    def __init__(
        self, model: Eagle3Model, target: NativeForward, lib: ctypes.CDLL, positions: int, int8: bool = False
    ) -> None:
        config, layer = model.config, model.midlayer
        attention, mlp = layer.self_attn, layer.mlp
        self.lib, self.target = lib, target  # the target's embedding must outlive our pointer to it
        # Its linear weights in int8 or bfloat16 whatever the target's: fewer bytes a step streams;
        # the drafts' precision moves only how many are kept, never the output.
        self.weights = weights = Weights(torch.int8 if int8 else torch.bfloat16)
        qkv = torch.cat((attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight))
        self._layer = (Layer * 1)(
            Layer(
                weights.keep(layer.input_layernorm.weight),
                weights.linear(qkv),
                None,
                None,
                weights.linear(attention.o_proj.weight),
                weights.keep(layer.post_attention_layernorm.weight),
                weights.gate_up(torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)), None, config.intermediate_size),
                weights.linear(mlp.down_proj.weight),
            )
        )
        self.hidden_norm = weights.keep(layer.hidden_norm.weight)
        self.norm_before_residual = config.norm_before_residual
        self.fc = weights.linear(model.fc.weight)
        cos, sin = model.rope(torch.arange(positions, device=model.fc.weight.device))
        self.model = Model(
            1,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.draft_vocab_size,
            config.sliding_window or 0,
            config.rms_norm_eps,
            target.model.embed,
            target.model.embed_bf16,
            target.model.embed_rows,
            weights.keep(model.norm.weight),
            weights.keep(cos[:, 0]),
            weights.keep(sin[:, 0]),
            weights.linear(model.lm_head.weight),
            self._layer,
        )
        self.hidden_size, self.draft_vocab = config.hidden_size, config.draft_vocab_size
        self._cache = CacheStructs()

    def step(
        self,
        cache: KVCache,
        tokens: list[int],
        features: Tensor,
        slots: list[int],
        positions: list[int],
        selected: list[int],
        taps: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Token t (reading tokens[t] beside features[t], float32 [tokens, hidden]; with `taps`,
        the target's tapped hidden states side by side, which fc fuses) becomes an entry of
        slots[t] at positions[t]; the `selected` tokens finish the layer: their output features
        [outputs, hidden] and draft-vocabulary logits [outputs, draft vocab]."""
        count, outputs = len(tokens), len(selected)
        features = features.float().contiguous()
        ids = (ctypes.c_int64 * count)(*tokens)
        meta, (slot, position, chosen) = int32_lists(slots, positions, selected)
        out = torch.empty(outputs, self.hidden_size)
        logits = torch.empty(outputs, self.draft_vocab)
        failed = self.lib.adaspec_eagle3_step(
            ctypes.byref(self.model),
            self.hidden_norm,
            int(self.norm_before_residual),
            ctypes.byref(self.fc) if taps else None,
            ctypes.byref(self._cache(cache)),
            count,
            ctypes.addressof(ids),
            features.data_ptr(),
            slot,
            position,
            outputs,
            chosen,
            out.data_ptr(),
            logits.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the compiled EAGLE-3 step could not allocate its activations")
        return out, logits

    def chain(
        self,
        cache: KVCache,
        slots: list[int],
        starts: list[int],
        steps: list[int],
        first: list[int],
        features: Tensor,
        draft_ids: Tensor,
        sampling: Sampling | None = None,
        floor: float = 0.0,
        first_kept: Sequence[bool] | None = None,
    ) -> list[list[int]]:
        """Chains in one call: row r drafts `steps[r]` tokens after its first draft `first[r]`,
        from its last verified output feature (`features` [rows, hidden]), its entries written at
        starts[r] onwards, each draft id mapped to a target id by `draft_ids` (int64). Greedy, or
        drawn as `sampling` says (its probs filled in past each row's first draft). A greedy row
        stops at a draft of probability below `floor`, without it; a row whose `first_kept`
        is False drafts nothing. Each row's drafts, its first included."""
        rows, width = len(slots), max(steps) + 1
        tokens = torch.zeros(rows, width, dtype=torch.long)
        tokens[:, 0] = torch.tensor(first)
        features = features.float().contiguous().clone()  # the kernel overwrites it step by step
        kept = [1] * rows if first_kept is None else [int(k) for k in first_kept]
        meta, (*per_row, drafted) = int32_lists(slots, starts, steps, kept)
        drawn = (0, 0, 0, 0)
        if sampling is not None:
            assert sampling.uniforms.shape == (rows, width) and sampling.probs.shape[:2] == (rows, width)
            parts = (sampling.inv_temperature, sampling.top_p, sampling.uniforms, sampling.probs)
            drawn = tuple(part.data_ptr() for part in parts)
        failed = self.lib.adaspec_eagle3_chain(
            ctypes.byref(self.model),
            self.hidden_norm,
            int(self.norm_before_residual),
            ctypes.byref(self._cache(cache)),
            rows,
            *per_row,
            draft_ids.contiguous().data_ptr(),
            features.data_ptr(),
            tokens.data_ptr(),
            width,
            *drawn,
            floor,
            drafted,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the compiled EAGLE-3 chain could not allocate its activations")
        return [row[: drafted[r]] for r, row in enumerate(tokens.tolist())]

    def round(
        self,
        cache: KVCache,
        tokens: list[int],
        taps: Tensor,
        slots: list[int],
        positions: list[int],
        selected: list[int],
        steps: list[int],
        draft_ids: Tensor,
        next_features: Tensor,
        next_logits: Tensor,
        floor: float = 0.0,
    ) -> list[list[int]]:
        """A round's greedy drafting in one call: the draft-extend (`step` with taps), whose
        selected outputs become their slots' rows of `next_features` and `next_logits` (float32,
        by slot), then each selected row's chain as `chain` drafts it, `steps[r]` steps after the
        first draft, stopping where `chain` stops. Each row's drafts, its first included."""
        count, rows, width = len(tokens), len(selected), max(steps) + 1
        taps = taps.float().contiguous()
        ids = (ctypes.c_int64 * count)(*tokens)
        meta, (slot, position, chosen, chain_steps, drafted) = int32_lists(
            slots, positions, selected, steps, [0] * rows
        )
        drafts = torch.zeros(rows, width, dtype=torch.long)
        failed = self.lib.adaspec_eagle3_round(
            ctypes.byref(self.model),
            self.hidden_norm,
            int(self.norm_before_residual),
            ctypes.byref(self.fc),
            ctypes.byref(self._cache(cache)),
            count,
            ctypes.addressof(ids),
            taps.data_ptr(),
            slot,
            position,
            rows,
            chosen,
            chain_steps,
            draft_ids.contiguous().data_ptr(),
            next_features.data_ptr(),
            next_logits.data_ptr(),
            drafts.data_ptr(),
            width,
            floor,
            drafted,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the compiled EAGLE-3 round could not allocate its activations")
        return [row[: drafted[r]] for r, row in enumerate(drafts.tolist())]
