"""Modules the decoder shares with its drafters: linear layers and an embedding that can run
from copies made once from their weights, or be served from quantized panels alone.

A layer served from quantized panels (engine/native/weights.py `GroupPanels`: a GGUF's blocks as
stored, or engine.weights' groups, once the compiled forward serves the model) keeps no float
weight: its parameter is on the meta device, so that its bytes are not held twice. Whatever needs
the float values dequantizes them from the panels (`float_weight`); PyTorch's operators cannot run
the layer, and say so (`operator_weight`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from engine.model.quantize import GroupQuantized
    from engine.native.weights import GroupPanels

SERVED_PACKED = (
    "its weights are kept only as the compiled CPU forward's quantized panels; load it with"
    " native_forward=False to run, train, move or convert it in PyTorch"
)


class DerivedCopy:
    """A module mixin for copies made from the parameters (the attributes named in `derived`):
    moving, converting or loading them drops those, so that nothing runs from stale weights."""

    derived: tuple[str, ...]

    def _drop_derived(self) -> None:
        for name in self.derived:
            setattr(self, name, None)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Checked before anything is dropped: a model refused is left as it was, still served.
        if served_packed(self):  # type: ignore[arg-type]
            raise RuntimeError(f"cannot move or convert the model: {SERVED_PACKED}")
        self._drop_derived()
        return super()._apply(fn, recurse)  # type: ignore[misc]

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if served_packed(self):  # type: ignore[arg-type]
            raise RuntimeError(f"cannot load weights into the model: {SERVED_PACKED}")
        self._drop_derived()
        super()._load_from_state_dict(*args, **kwargs)  # type: ignore[misc]


class Linear(DerivedCopy, nn.Linear):
    """nn.Linear that can run from a copy of its weight packed once for oneDNN's CPU kernels.

    Decoding is a matrix-vector product per layer, bound by how fast the weights stream from
    memory. MKL's float32 GEMV behind F.linear reaches a fraction of the memory bandwidth on some
    CPUs (about 12 GB/s against oneDNN's 40 GB/s on the AMD EPYC we test on); the packed weight
    is the same float32 values in oneDNN's blocked layout. The plain weight stays the source of
    truth for saving, training and quantization: moving, converting or loading it drops the copy.

    A layer quantized in groups (engine/model/quantize.py) keeps them in `quantized`, for the
    compiled forward to stream; its weight then holds their float32 values, or, served from
    panels alone, is on the meta device.
    """

    packed: Tensor | None = None
    quantized: GroupQuantized | GroupPanels | None = None
    derived = ("packed", "quantized")

    def pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(operator_weight(self).detach(), None)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, operator_weight(self), self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    # bfloat16 needs the CPU's bfloat16 instructions (a forward of 4 rows of 13 tokens: 6.7 ms
    # packed, 7.7 ms through F.linear, on an EPYC with AVX512-BF16).
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Embedding(DerivedCopy, nn.Embedding):
    """nn.Embedding that may be served from quantized panels alone, as `Linear` (`quantized`)."""

    quantized: GroupQuantized | GroupPanels | None = None
    derived = ("quantized",)

    def forward(self, tokens: Tensor) -> Tensor:
        operator_weight(self)  # a one-line error rather than the meta device's
        return super().forward(tokens)


def served_packed(module: nn.Module) -> bool:
    """Whether any layer of `module` is kept only as quantized panels: its weight on meta beside
    them (engine/native/weights.py `serve_packed`)."""
    return any(getattr(m, "quantized", None) is not None and m.weight.is_meta for m in module.modules())


def operator_weight(module: Linear | Embedding) -> Tensor:
    """`module`'s weight, or a one-line error where it is kept only as quantized panels."""
    if module.weight.is_meta and module.quantized is not None:  # a model moved to meta on purpose runs there
        raise RuntimeError(f"a {type(module).__name__} of {tuple(module.weight.shape)}: {SERVED_PACKED}")
    return module.weight


def float_weight(module: Linear | Embedding) -> Tensor:
    """`module`'s weight as float values: itself, or dequantized on demand from its panels."""
    if module.weight.is_meta and module.quantized is not None:
        return module.quantized.dequantize()
    return operator_weight(module)
