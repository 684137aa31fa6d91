"""Linear weights stored as small integers in groups: each output row's inputs come in groups of
`group` consecutive values, each group with a float32 scale (and min), and a weight is
values * scale + min computed in float32. The compiled CPU kernels stream them so (int8, or uint4
two to a byte) and widen them to float32 in registers; everywhere else the model holds the same
float32 values, so that the model as served is one model whichever forward runs it.

GGUF's block formats are these layouts once unpacked, without loss (d, dmin: the block's fp16
scales, widened to float32 exactly; sc, m: a Q4_K sub-block's 6-bit scale and min; each product
below is exact in float32, so q * scale + min rounds once however it is computed):

- Q8_0: `int8_groups(q, d, group=32)`;
- Q4_0: `uint4_groups(q, d, -8 * d, group=32)`;
- Q4_1: `uint4_groups(q, d, m, group=32)`;
- Q4_K: `uint4_groups(q, d * sc, -(dmin * m), group=32)` (its 32-value sub-blocks);
- Q6_K: `int8_groups(q - 32, d * sc, group=16)` (its 16-value sub-blocks, int8 scales).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

GROUP = 32  # inputs per group of `quantize_int8_groups` and `quantize_int4_groups`, as Q8_0 and Q4_1


@dataclass(frozen=True)
class GroupQuantized:
    """A weight [n, k] as `values` (int8, or uint8 holding 0..15 for uint4: one a byte until the
    kernels' panels pack two), `scales` and `mins` (float32 [n, ceil(k / group)]; mins None: 0)."""

    values: Tensor
    scales: Tensor
    mins: Tensor | None
    group: int

    @property
    def uint4(self) -> bool:
        return self.values.dtype == torch.uint8

    def per_value(self, groups: Tensor) -> Tensor:
        """`groups` [n, ceil(k / group)] repeated over the inputs of each group: [n, k]."""
        return groups.repeat_interleave(self.group, dim=1)[:, : self.values.shape[1]]

    def dequantize(self) -> Tensor:
        """The float32 weights: values * scale + min, each rounded to float32 as the kernels round them."""
        weight = self.values.float() * self.per_value(self.scales)
        return weight if self.mins is None else weight + self.per_value(self.mins)


def _checked(values: Tensor, scales: Tensor, mins: Tensor | None, group: int) -> GroupQuantized:
    if values.dim() != 2 or group < 1:
        raise ValueError(f"grouped weights need values [n, k] and a group of at least 1, not {tuple(values.shape)}")
    n, k = values.shape
    shape = (n, -(-k // group))
    for name, tensor in (("scales", scales), ("mins", mins)):
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} of {n} rows of {k} values in groups of {group} must be {shape}, not {tuple(tensor.shape)}"
            )
    return GroupQuantized(
        values.contiguous(),
        scales.float().contiguous(),
        mins.float().contiguous() if mins is not None else None,
        group,
    )


def int8_groups(values: Tensor, scales: Tensor, mins: Tensor | None = None, group: int = GROUP) -> GroupQuantized:
    """Int8 `values` [n, k] with a float32 scale (and min) per `group` inputs of a row."""
    return _checked(values.to(torch.int8), scales, mins, group)


def uint4_groups(values: Tensor, scales: Tensor, mins: Tensor | None, group: int = GROUP) -> GroupQuantized:
    """4-bit unsigned `values` [n, k] (0..15, one an element) with a float32 scale and min per
    `group` inputs of a row."""
    if values.numel() and (values.min() < 0 or values.max() > 15):
        raise ValueError("uint4 values must lie in 0..15")
    return _checked(values.to(torch.uint8), scales, mins, group)


def _grouped(weight: Tensor, group: int) -> Tensor:
    """weight [n, k] as float32 [n, groups, group], the last group zero-padded."""
    w = weight.detach().float()
    n, k = w.shape
    padded = torch.zeros(n, -(-k // group) * group)
    padded[:, :k] = w
    return padded.view(n, -1, group)


def _half(t: Tensor) -> Tensor:
    """`t` rounded to float16 and back, as GGUF stores a block's scales: a product of one and a
    value of at most 8 bits is then exact in float32 (see the module's docstring)."""
    return t.to(torch.float16).float()


def quantize_int8_groups(weight: Tensor, group: int = GROUP) -> GroupQuantized:
    """As Q8_0: each group's largest magnitude becomes 127 (symmetric, zero stays zero), the scale
    a float16."""
    w = _grouped(weight, group)
    scales = _half(w.abs().amax(dim=2) / 127)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(w / safe[..., None]).clamp(-127, 127)
    return int8_groups(values.flatten(1)[:, : weight.shape[1]], scales, None, group)


def quantize_int4_groups(weight: Tensor, group: int = GROUP) -> GroupQuantized:
    """As Q4_1: each group's values from its min to its max in 16 steps, scale and min float16."""
    w = _grouped(weight, group)
    k = weight.shape[1]
    real = torch.arange(w.shape[1] * group).view(1, -1, group) < k  # the padding takes no part
    mins = _half(torch.where(real, w, torch.inf).amin(dim=2))
    scales = _half((torch.where(real, w, -torch.inf).amax(dim=2) - mins) / 15)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round((w - mins[..., None]) / safe[..., None]).clamp(0, 15)
    return uint4_groups(values.flatten(1)[:, :k], scales, mins, group)


QUANTIZERS = {"int8": quantize_int8_groups, "int4": quantize_int4_groups}


@torch.no_grad()
def serve_quantized(linear: nn.Module, quantized: GroupQuantized) -> None:
    """`linear` (a float32 engine.model.transformer.Linear) served from `quantized`: it keeps the
    groups, which the compiled forward streams, and its weight becomes their float32 values in
    place (a tied embedding with it), which every other forward computes with. A compiled
    forward built before holds the weight it replaces: the model's `native` must be rebuilt."""
    if linear.weight.dtype != torch.float32 or tuple(linear.weight.shape) != tuple(quantized.values.shape):
        raise ValueError(
            f"grouped weights {tuple(quantized.values.shape)} are served in a float32 weight of that shape,"
            f" not {linear.weight.dtype} {tuple(linear.weight.shape)}"
        )
    linear.weight.copy_(quantized.dequantize())
    linear.quantized = quantized
    linear.packed = None  # packed from the weight it replaces


def quantizer(kind: str) -> Callable[[Tensor], GroupQuantized]:
    """engine.weights' quantizer `kind` ("int8" or "int4"); ValueError naming the choices."""
    if kind not in QUANTIZERS:
        raise ValueError(f"weights must be one of {', '.join(map(repr, QUANTIZERS))}, not {kind!r}")
    return QUANTIZERS[kind]


def quantize_linears(model: nn.Module, kind: str) -> None:
    """Every linear layer of `model` (a float32 Transformer) quantized by `kind` ("int8" or
    "int4") and served so, the lm head included, tied or not."""
    quantize = quantizer(kind)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            serve_quantized(module, quantize(module.weight))
    model.native = None  # built from the weights they replace
