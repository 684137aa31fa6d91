"""What the kernels read: parameters packed into panels (float32, bfloat16, int8, or int8 and
uint4 in groups), the structures that point into them, and one forward call."""

from __future__ import annotations

import ctypes
import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from engine.native.abi import Batch, Cache, Linear, Model

if TYPE_CHECKING:
    from engine.model.config import DFlashConfig, ModelConfig
    from engine.model.kv_cache import KVCache
    from engine.model.quantize import GroupQuantized

_i32 = ctypes.c_int32

_ptr = ctypes.c_void_p


def int32_lists(*lists: Sequence[int]) -> tuple[ctypes.Array, list[Any]]:
    """The lists packed into one int32 buffer, and a pointer to each list in it; the caller keeps
    the buffer alive while the kernels read it."""
    buffer = (_i32 * sum(len(values) for values in lists))(*itertools.chain.from_iterable(lists))
    address, pointers = ctypes.addressof(buffer), []
    for values in lists:
        pointers.append(ctypes.cast(address, ctypes.POINTER(_i32)))
        address += ctypes.sizeof(_i32) * len(values)
    return buffer, pointers


PANEL = 64  # output columns per weight panel, as in kernels.c

# How a Linear's panels are stored (kernels.h's enum): all but float32 are widened as they are read.
FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
UINT4 = 3


def panels(weight: Tensor) -> Tensor:
    """[n, k] -> [ceil(n / PANEL), k, PANEL]: each panel's PANEL output columns side by side, in
    the weight's dtype (bfloat16 stays bfloat16: the kernels widen it as they read it)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight.detach()
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def int8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [n, k] as int8 values and a float32 scale per output row, weight ~ values * scale[:, None]:
    each row's largest magnitude becomes 127 (symmetric, so zero stays exactly zero)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def gate_up_rows(t: Tensor, inter: int) -> Tensor:
    """The fused [gate; up] rows of `t` (a weight, its groups' scales, or a vector with a value
    per output) with gate and up rows alternating PANEL / 2 at a time, each half zero-padded to a
    multiple of PANEL / 2, so that each panel yields finished SiLU(gate) * up columns (kernels.c
    `linear_glu`)."""
    half = PANEL // 2
    padded = -(-inter // half) * half
    gate, up = torch.zeros(2, padded, *t.shape[1:], dtype=t.dtype)
    gate[:inter], up[:inter] = t[:inter].detach(), t[inter:].detach()
    return torch.stack((gate.view(-1, half, *t.shape[1:]), up.view(-1, half, *t.shape[1:])), 1).flatten(0, 2)


def gate_up_panels(weight: Tensor, inter: int, *vectors: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
    """The fused [gate; up] weight's panels (`gate_up_rows`), and `vectors` (a bias, int8
    scales: one value per output) reordered the same way."""
    rows = [gate_up_rows(v, inter).float().contiguous() if v is not None else None for v in vectors]
    return panels(gate_up_rows(weight, inter)), rows


def padded_tokens(rows: Sequence[Sequence[int]], width: int) -> ctypes.Array:
    """Each row's tokens right-padded with 0 to `width`, as the kernels' int64 [rows, width]."""
    padded = itertools.chain.from_iterable([*t, *[0] * (width - len(t))] for t in rows)
    return (ctypes.c_int64 * (len(rows) * width))(*padded)


class Weights:
    """Copies of parameters in the layouts the kernels read, kept alive while structures point into them."""

    def __init__(self, linears: torch.dtype) -> None:
        self.linears = linears  # how linear weights are stored (FORMATS)
        self.kept: list[Tensor] = []

    def keep(self, tensor: Tensor | None, dtype: torch.dtype = torch.float32) -> int | None:
        if tensor is None:
            return None
        tensor = tensor.detach().to(dtype).contiguous()
        self.kept.append(tensor)
        return tensor.data_ptr()

    def _stored(self, weight: Tensor) -> tuple[Tensor, Tensor | None]:
        """The weight's values as stored, and int8's scales."""
        if self.linears == torch.int8:
            return int8_rows(weight)
        return weight.detach().to(self.linears), None

    def linear(self, weight: Tensor, bias: Tensor | None = None, quantized: GroupQuantized | None = None) -> Linear:
        """A linear layer's panels: its `quantized` groups where it has them, else in `linears`."""
        if quantized is not None:
            return self._grouped(quantized, bias)
        values, scale = self._stored(weight)
        packed = panels(values)
        self.kept.append(packed)
        n, k = weight.shape
        return Linear(packed.data_ptr(), self.keep(bias), self.keep(scale), None, n, k, FORMATS[self.linears], 0)

    def gate_up(
        self, weight: Tensor, bias: Tensor | None, inter: int, quantized: GroupQuantized | None = None
    ) -> Linear:
        if quantized is not None:
            return self._grouped(quantized, bias, inter)
        values, scale = self._stored(weight)
        packed, (bias, scale) = gate_up_panels(values, inter, bias, scale)
        self.kept.append(packed)
        n, k = packed.shape[0] * PANEL, weight.shape[1]
        return Linear(packed.data_ptr(), self.keep(bias), self.keep(scale), None, n, k, FORMATS[self.linears], 0)

    def _grouped(self, q: GroupQuantized | GroupPanels, bias: Tensor | None, inter: int | None = None) -> Linear:
        """Grouped weights as panels: `q`'s own where it is packed already (no copy), else packed
        here (`pack_groups`); the gate/up interleaving given `inter`."""
        if not isinstance(q, GroupPanels):
            q = pack_groups(q, inter)
        elif q.gate_up != inter:
            raise ValueError(f"panels packed for gate/up {q.gate_up} served as gate/up {inter}")
        if inter is not None and bias is not None:
            bias = gate_up_rows(bias, inter)
        self.kept.extend(t for t in (q.values, q.scales, q.mins) if t is not None)
        return Linear(
            q.values.data_ptr(),
            self.keep(bias),
            q.scales.data_ptr(),
            q.mins.data_ptr() if q.mins is not None else None,
            q.n,
            q.k,
            UINT4 if q.uint4 else FORMATS[torch.int8],
            q.group,
            q.scales.dtype == torch.float16,
        )


@dataclass(frozen=True)
class GroupPanels:
    """A weight in groups (engine/model/quantize.py) as the kernels stream it, made once by
    `pack_groups`: a model served from quantized weights keeps only this (a byte, or half a byte,
    a weight; its scales and mins a float16 or float32 a group), and anything else that needs the weight
    dequantizes it from here (`dequantize`)."""

    values: Tensor  # int8 [panels, k, PANEL], or uint8 [panels, k, PANEL / 2] holding uint4 two a byte
    scales: Tensor  # [panels, groups, PANEL]: float16 where every one (and every min) is exact so, else float32
    mins: Tensor | None
    n: int  # output rows the kernels compute (gate/up's padded and interleaved)
    k: int
    group: int
    uint4: bool
    gate_up: int | None  # the intermediate size where gate and up rows are interleaved (`gate_up_rows`)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.scales, self.mins) if t is not None)

    def dequantize(self) -> Tensor:
        """The float32 weight [rows, k] these panels stand for, rows in the model's order: values *
        scale + min, rounded as the kernels round them (every product is exact)."""
        values = self.values
        if self.uint4:
            values = torch.cat((values & 15, values >> 4), dim=-1)
        per_value = lambda t: t.repeat_interleave(self.group, dim=1)[:, : self.k]  # noqa: E731
        weight = values.float() * per_value(self.scales.float())
        if self.mins is not None:
            weight += per_value(self.mins.float())
        rows = weight.transpose(1, 2).reshape(-1, self.k)
        if self.gate_up is None:
            return rows[: self.n]
        gate, up = rows.view(-1, 2, PANEL // 2, self.k).unbind(1)
        return torch.cat((gate.reshape(-1, self.k)[: self.gate_up], up.reshape(-1, self.k)[: self.gate_up]))


def pack_groups(q: GroupQuantized, inter: int | None = None) -> GroupPanels:
    """`q` in panels (the gate/up interleaving given `inter`): values, uint4 two to a byte (a panel
    row's column j low, j + 32 high), and each group's scale and min arranged as the values are,
    [panels, groups, PANEL]."""
    if inter is None:
        arrange: Callable[[Tensor], Tensor] = panels
    else:
        arrange = lambda t: panels(gate_up_rows(t, inter))  # noqa: E731
    packed = arrange(q.values)
    if q.uint4:
        half = PANEL // 2
        packed = (packed[..., :half] | (packed[..., half:] << 4)).contiguous()
    scales, mins = (arrange(t).float().contiguous() if t is not None else None for t in (q.scales, q.mins))
    # Half the bytes where every scale and min is exact in float16 (GGUF's Q8_0, Q4_0 and Q4_1
    # store them so; a Q4_K super-block's 6-bit scales times its float16 d often are not).
    if all(torch.equal(t.half().float(), t) for t in (scales, mins) if t is not None):
        scales, mins = (t.half() if t is not None else None for t in (scales, mins))
    n = packed.shape[0] * PANEL if inter is not None else q.values.shape[0]
    return GroupPanels(packed, scales, mins, n, q.values.shape[1], q.group, q.uint4, inter)


def serve_packed(module: nn.Module, quantized: GroupQuantized, gate_up: int | None = None) -> None:
    """`module` (an engine.model.layers Linear or Embedding) served from `quantized` by the kernels
    alone: packed into panels once (the gate/up interleaving given `gate_up`), which are then the
    only copy kept; its weight goes to the meta device, and whatever needs its float values
    dequantizes them from the panels (engine/model/layers.py)."""
    module.quantized = pack_groups(quantized, gate_up)
    module.weight = nn.Parameter(torch.empty(quantized.values.shape, device="meta"), requires_grad=False)
    if hasattr(module, "packed"):
        module.packed = None  # oneDNN's copy of the weight it replaces


class CacheStructs:
    """The kernels' view of each KV cache a forward runs on, made once per cache."""

    def __init__(self) -> None:
        self._made: weakref.WeakKeyDictionary[KVCache, Cache] = weakref.WeakKeyDictionary()

    def __call__(self, cache: KVCache) -> Cache:
        found = self._made.get(cache)
        if found is None:
            k, v = cache.k, cache.v
            if not cache.transposed_keys or k.dtype != torch.float32 or not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError("the compiled kernels need a float32 KV cache with transposed keys (model.new_cache)")
            found = Cache(k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.shape[-1], v.stride(0), v.stride(1))
            self._made[cache] = found
        return found


def model_struct(config: ModelConfig | DFlashConfig, sliding_window: int, *pointers: object) -> Model:
    """The kernels' model: its shape from `config`, then embed, embed_bf16, embed_rows, norm, rope_cos,
    rope_sin, lm_head and layers."""
    return Model(
        config.num_layers,
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        sliding_window,
        config.rms_norm_eps,
        *pointers,
    )


def run_forward(
    lib: ctypes.CDLL,
    model: Model,
    cache: Cache,
    tokens: tuple[int, int, int],  # rows, width, address of int64 [rows, width]
    rows_meta: tuple[list[int], list[int], list[int]],  # slot, start, count per row
    logits: Tensor,
    hidden: dict[int, Tensor],
    last_only: bool = False,
    block: bool = False,
    outputs: tuple[int, int] = (0, 0),  # first and count of each row's tokens with logits (count 0: all)
    argmax: Tensor | None = None,  # int64, laid out as logits without its last dimension
) -> None:
    rows, width, address = tokens
    slots, starts, counts = rows_meta
    meta, per_row = int32_lists(slots, starts, counts)
    layers = (_i32 * len(hidden))(*hidden)
    addresses = (_ptr * len(hidden))(*[t.data_ptr() for t in hidden.values()])
    # Every captured tensor is [rows, width, hidden] with its tokens `stride` floats apart: its own
    # tensor, or a view of one that holds the layers side by side (`Captured`).
    strides = {t.stride(1) for t in hidden.values()}
    if len(strides) > 1 or any(t.stride(2) != 1 or t.stride(0) != width * t.stride(1) for t in hidden.values()):
        raise ValueError("captured hidden states must share one layout, [rows, width, hidden] with tokens evenly apart")
    stride = strides.pop() if strides else 0
    call = Batch(
        rows,
        width,
        address,
        *per_row,
        int(last_only),
        logits.data_ptr(),
        len(hidden),
        layers,
        addresses,
        torch.get_num_threads(),
        int(block),
        *outputs,
        stride,
        argmax.data_ptr() if argmax is not None else None,
    )
    if lib.adaspec_forward(ctypes.byref(model), ctypes.byref(cache), ctypes.byref(call)):
        raise MemoryError("the compiled forward could not allocate its activations")
