"""Weights quantized in groups (engine/model/quantize.py): GGUF's block formats, unpacked into
int8 or uint4 groups, are served at exactly the float32 values they stand for, on the compiled
forward and PyTorch's alike; engine.weights quantizes a float checkpoint as Q8_0 and Q4_1 do."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint, use_native
from engine.model.quantize import (
    int8_groups,
    quantize_int4_groups,
    quantize_int8_groups,
    serve_quantized,
    uint4_groups,
)
from engine.model.transformer import ForwardBatch
from engine.native.build import library
from tests.conftest import save_tiny, tiny_hf_model


def fp16(shape: tuple[int, ...], generator: torch.Generator, scale: float = 0.01) -> torch.Tensor:
    """Random positive block scales as GGUF stores them: float16, widened exactly."""
    return (torch.rand(shape, generator=generator) * scale + scale / 10).half().float()


def gguf_like(kind: str, n: int, k: int, generator: torch.Generator):
    """Random blocks of a GGUF format `kind`, unpacked into this layout as engine/model/quantize.py says."""
    ints = lambda lo, hi, shape: torch.randint(lo, hi + 1, shape, generator=generator)  # noqa: E731
    if kind == "Q8_0":
        return int8_groups(ints(-127, 127, (n, k)), fp16((n, k // 32), generator), group=32)
    if kind == "Q4_0":
        d = fp16((n, k // 32), generator)
        return uint4_groups(ints(0, 15, (n, k)), d, -8 * d, group=32)
    if kind == "Q4_K":  # 32-value sub-blocks: 6-bit scales and mins times the super-block's d and dmin
        d, dmin = fp16((n, 1), generator, 0.001), fp16((n, 1), generator, 0.001)
        sc, m = ints(0, 63, (n, k // 32)), ints(0, 63, (n, k // 32))
        return uint4_groups(ints(0, 15, (n, k)), d * sc, -(dmin * m), group=32)
    if kind == "Q6_K":  # 16-value sub-blocks, int8 scales, values 0..63 stored less 32
        d = fp16((n, 1), generator, 0.0001)
        return int8_groups(ints(0, 63, (n, k)) - 32, d * ints(-128, 127, (n, k // 16)), group=16)
    # A group that does not divide the row (its last is shorter), with mins: the layout's general case.
    groups = -(-k // 40)
    return int8_groups(ints(-128, 127, (n, k)), fp16((n, groups), generator), fp16((n, groups), generator), 40)


def forward(model, cache, tokens):
    return model(ForwardBatch.build(cache, [0], [tokens], model.config.sliding_window), cache).logits[0]


@pytest.mark.skipif(library() is None, reason="no compiled kernels")
@torch.inference_mode()
def test_gguf_blocks_unpacked_into_groups_are_served_at_exactly_their_float32_values(tmp_path):
    """Each GGUF format a Q4_K_M or Q8_0 file holds, handed over as (values, scales, mins): the
    layout's values are exactly the format's (every product exact in float32); the compiled
    forward streams them with the logits of the compiled float32 forward of those values bit for
    bit, within 1e-5 of the logits' scale of PyTorch's, and a verify gives its decode steps'."""
    path = save_tiny(tiny_hf_model("llama", vocab_size=64, intermediate_size=96), tmp_path / "llama")
    served, plain = (load_checkpoint(path, dtype="float32") for _ in range(2))
    operators = load_checkpoint(path, dtype="float32", native_forward=False).model
    model, generator = served.model, torch.Generator().manual_seed(0)
    kinds = {"qkv": "Q4_K", "o_proj": "Q6_K", "gate_up": "Q8_0", "down_proj": "Q4_0", "lm_head": "Q6_K"}
    for name, module in model.named_modules():
        kind = kinds.get(name.rsplit(".", 1)[-1])
        if kind is not None:
            kind = "groups of 40" if name.startswith("layers.1.self_attn") else kind
            quantized = gguf_like(kind, *module.weight.shape, generator)
            exact = quantized.values.double() * quantized.per_value(quantized.scales).double()
            if quantized.mins is not None:
                exact += quantized.per_value(quantized.mins).double()
            serve_quantized(module, quantized)
            assert torch.equal(module.weight.double(), exact.float().double()), name  # rounded once
    model.native = None  # built from the weights they replaced
    assert use_native(model)
    for other in (plain.model, operators):
        other.load_state_dict(model.state_dict())
    assert use_native(plain.model)
    prompt, drafts = [(5 * i) % 61 + 2 for i in range(60)], [3, 9, 27, 17]
    caches = [m.new_cache(1, 128) for m in (model, plain.model, operators)]
    for cache in caches:
        cache.allocate()
    prefill = [forward(m, c, prompt) for m, c in zip((model, plain.model, operators), caches)]
    verify = [forward(m, c, drafts) for m, c in zip((model, plain.model, operators), caches)]
    for logits in (prefill, verify):
        assert torch.equal(logits[0], logits[1])
        assert (logits[0] - logits[2]).abs().max() <= 1e-5 * logits[2].abs().max()
    caches[0].truncate(0, len(prompt))
    assert torch.equal(verify[0], torch.stack([forward(model, caches[0], [t])[0] for t in drafts]))


def test_float_weights_quantize_as_q8_0_and_q4_1_do():
    """int8: each group of 32's largest magnitude becomes 127 against a float16 scale; int4: 16
    steps from the group's min, scale and min float16; every weight within half a step (and the
    min's rounding) of its own."""
    weight = torch.randn(48, 80, generator=torch.Generator().manual_seed(3)) * 0.05
    int8 = quantize_int8_groups(weight)
    assert int8.values.dtype == torch.int8 and int8.scales.shape == (48, 3) and int8.mins is None
    assert torch.equal(int8.scales, int8.scales.half().float())
    assert (int8.values.abs().view(48, -1).amax(dim=1) == 127).all()
    step = int8.per_value(int8.scales)
    assert ((int8.dequantize() - weight).abs() <= step / 2 * 1.01).all()
    int4 = quantize_int4_groups(weight)
    assert int4.uint4 and int4.values.min() >= 0 and int4.values.max() <= 15 and int4.mins is not None
    assert torch.equal(int4.mins, int4.mins.half().float())
    step, off = int4.per_value(int4.scales), int4.per_value(int4.mins)
    assert ((int4.dequantize() - weight).abs() <= step / 2 + (off - off.half().float()).abs() + 1e-3 * step).all()
    with pytest.raises(ValueError, match="0..15"):
        uint4_groups(torch.full((2, 32), 16), torch.ones(2, 1), torch.zeros(2, 1))
    with pytest.raises(ValueError, match=r"must be \(2, 2\)"):
        int8_groups(torch.zeros(2, 64), torch.ones(2, 1), group=32)
