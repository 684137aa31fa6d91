"""A GGUF's quantized matrices served as the file stores them: Q8_0, Q4_0, Q4_1, Q4_K and Q6_K
blocks go straight into the compiled kernels' panels, no float copy of them is kept, and the
logits are the compiled float32 forward's of the dequantized weights, bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from bench.published import SMOLLM2
from engine.checkpoint import hf_names, load_checkpoint, to_hf_state_dict, use_native
from engine.core import Engine
from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.generate import generate
from engine.model.transformer import ForwardBatch
from engine.native.build import library
from engine.native.weights import GroupPanels
from engine.request import Request
from engine.sampling import SamplingParams
from tests.conftest import DEFAULT_DRAFT, DEFAULT_TARGET, ROOT, needs_smollm2, tiny_hf_model
from tests.gguf_files import gguf_name, write_gguf

pytestmark = pytest.mark.skipif(library() is None, reason="no compiled kernels")

Q = gguf.GGMLQuantizationType
# Bytes a weight of each type takes in the kernels' panels: its values, and a float32 scale (and
# min) per group (Q4_0's -8 * d is its min).
# Bytes a weight in the kernels' panels: its value, and its group's scale (and min) over the group,
# in float16 where the file stores them so (Q8_0, Q4_0, Q4_1), else float32 (a K-quant's products).
PANEL_BYTES = {Q.Q8_0: 1 + 2 / 32, Q.Q4_0: 0.5 + 4 / 32, Q.Q4_1: 0.5 + 4 / 32, Q.Q4_K: 0.5 + 8 / 32, Q.Q6_K: 1 + 4 / 16}
# A Q4_K_M file's mix: v, down and the output head in Q6_K, the rest in Q4_K.
Q4_K_M = {f"blk.{i}.{part}.weight": Q.Q6_K for i in range(2) for part in ("attn_v", "ffn_down")}
Q4_K_M["output.weight"] = Q.Q6_K
LINEARS = ("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up", "mlp.down_proj")


def tiny_llama(root: Path) -> Path:
    """A random Llama whose rows are whole K-quant super-blocks (256 inputs), with its own output
    head, and the default target's byte-level tokenizer."""
    model = tiny_hf_model(
        "llama", vocab_size=8192, hidden_size=256, intermediate_size=512, head_dim=64, tie_word_embeddings=False
    )
    model.save_pretrained(root)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(DEFAULT_TARGET / name, root / name)
    return root


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("quantized")
    tiny_llama(root / "tiny")
    return root


def written(files: Path, case: str) -> Path:
    """The GGUF of `case`: the default target (tied embedding) in Q8_0, Q4_0 or Q4_1, or the tiny
    Llama (its own head) in Q4_K, Q6_K or Q4_K_M's mix."""
    out = files / f"{case}.gguf"
    if out.exists():
        return out
    if case in ("Q8_0", "Q4_0", "Q4_1"):
        return write_gguf(DEFAULT_TARGET, out, Q[case])
    kind, types = (Q.Q4_K, Q4_K_M) if case == "Q4_K_M" else (Q[case], None)
    return write_gguf(files / "tiny", out, kind, types=types)


def forward(model, cache, tokens: list[int]) -> torch.Tensor:
    return model(ForwardBatch.build(cache, [0], [tokens]), cache).logits[0]


def float32_reference(path: Path):
    """The file dequantized to float32 (the path every other device takes), on the compiled
    float32 forward."""
    reference = load_checkpoint(path, native_forward=False)
    assert not any(p.is_meta for p in reference.model.parameters())
    assert use_native(reference.model)
    return reference


@pytest.mark.parametrize("case", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q4_K_M"])
@torch.inference_mode()
def test_quantized_blocks_serve_the_float32_logits_of_their_values_without_a_float_copy(files, case):
    path = written(files, case)
    served = load_checkpoint(path).model
    reference = float32_reference(path).model
    tied = served.config.tie_word_embeddings
    modules = [f"layers.{i}.{name}" for i in range(served.config.num_layers) for name in LINEARS]
    modules += ["lm_head"] if tied else ["lm_head", "embed_tokens"]
    stored = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in stored.tensors}
    expected = 0.0
    for name in modules:
        module = served.get_submodule(name)
        assert module.weight.is_meta and isinstance(module.quantized, GroupPanels), name
        expected += module.weight.numel() * _panel_bytes(served, name, types)
    assert served.embed_tokens.weight.is_meta  # read from panels, its own or the tied lm head's
    panels = {id(q): q.nbytes for m in served.modules() if isinstance(q := getattr(m, "quantized", None), GroupPanels)}
    assert sum(panels.values()) == pytest.approx(expected, rel=0.01)  # gate/up's padding aside

    prompt, drafts = [(37 * i) % 5000 + 7 for i in range(90)], [11, 4000, 29, 8000]
    caches = [m.new_cache(1, 128) for m in (served, reference)]
    for cache in caches:
        cache.allocate()
    prefill = [forward(m, c, prompt) for m, c in zip((served, reference), caches)]
    verify = [forward(m, c, drafts) for m, c in zip((served, reference), caches)]
    assert torch.equal(prefill[0], prefill[1]) and torch.equal(verify[0], verify[1])
    caches[0].truncate(0, len(prompt))
    steps = torch.stack([forward(served, caches[0], [t])[0] for t in drafts])
    assert torch.equal(verify[0], steps)


def _panel_bytes(model, name: str, types: dict[str, Q]) -> float:
    """The bytes a weight of our layer `name` takes in panels, from its parts' types in the file
    (a fused layer of mixed types is stored in the wider one, in the smaller group)."""
    if name == "lm_head":
        parts = [types.get("output.weight", types["token_embd.weight"])]
    else:
        parts = [types[gguf_name(hf)] for hf in hf_names(f"{name}.weight")]
    if len(set(parts)) == 1:
        return PANEL_BYTES[parts[0]]
    return 1 + 8 / 16  # int8 values in groups of 16, a scale and a min each


def engine_outputs(target, drafter, prompts: list[list[int]], k: int, tokens: int = 32) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine = Engine(target, drafter, len(prompts), 160, (0, 2, 5))
    requests = [Request(tuple(p), params) for p in prompts]
    outputs = engine.run_until_done(requests, k)
    return [outputs[r.id] for r in requests]


@torch.inference_mode()
def test_greedy_speculation_on_a_quantized_file_equals_its_target_only_output(files):
    """The n-gram drafter and a draft model (itself a Q8_0 file, int8 view and all) verify against
    the Q4_1 target served from its blocks: token for token what the target decodes alone."""
    target = load_checkpoint(written(files, "Q4_1"))
    draft = load_checkpoint(write_gguf(DEFAULT_DRAFT, files / "draft-q8_0.gguf", Q.Q8_0))
    assert draft.model.lm_head.weight.is_meta
    text = ["def add(a, b):\n    return a + b\n\ndef add(", "for i in range(10):\n    print(i)\nfor i in range("]
    prompts = [target.tokenizer.encode(t).ids for t in text]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = [c.tokens for c in generate(target, prompts, params)]
    for k in (2, 5):
        assert engine_outputs(target, NgramDrafter(min_n=1, max_n=3), prompts, k) == expected, k
        for quantize in (False, True):
            drafter = DraftModelDrafter(draft, len(prompts), 160, quantize=quantize)
            assert engine_outputs(target, drafter, prompts, k) == expected, (k, quantize)


@torch.inference_mode()
def test_what_needs_the_float_weights_dequantizes_them_or_says_why_not(files):
    """Saving dequantizes from the panels; PyTorch's operators, moving and loading are refused in
    one line, and leave the model served as it was."""
    path = written(files, "Q4_K_M")
    served = load_checkpoint(path)
    reference = load_checkpoint(path, native_forward=False)
    mine, theirs = to_hf_state_dict(served.model), to_hf_state_dict(reference.model)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    model, cache = served.model, served.model.new_cache(1, 16)
    cache.allocate()
    before = forward(model, cache, [5, 6, 7])
    native, model.native = model.native, None
    with pytest.raises(RuntimeError, match="kept only as the compiled CPU forward's quantized panels"):
        forward(model, model.new_cache(1, 16), [5, 6, 7])
    model.native = native
    for refused in (lambda: model.to(torch.float64), lambda: model.load_state_dict(reference.model.state_dict())):
        with pytest.raises(RuntimeError, match="quantized panels") as caught:
            refused()
        assert "\n" not in str(caught.value)
    cache.truncate(0, 0)
    assert model.native is not None and torch.equal(forward(model, cache, [5, 6, 7]), before)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_engine_weights_keep_no_float_copy_of_what_the_kernels_serve(weights):
    """engine.weights on a float checkpoint: its linear layers (the tied head, and with it the
    embedding) kept only in panels, a byte or half a byte a weight with a float32 scale (and min)
    per 32."""
    model = load_checkpoint(DEFAULT_TARGET, weights=weights).model
    assert model.lm_head.weight.is_meta and model.embed_tokens.weight is model.lm_head.weight
    float_bytes = sum(p.numel() * 4 for p in load_checkpoint(DEFAULT_TARGET, dtype="float32").model.parameters())
    per_weight = {"int8": 1 + 4 / 32, "int4": 0.5 + 8 / 32}[weights]
    assert model.native.weight_bytes < float_bytes * (per_weight / 4) * 1.1  # norms and RoPE tables besides


@needs_smollm2
@torch.inference_mode()
def test_the_published_q4_1_model_served_from_its_blocks_gives_the_dequantized_models_logits():
    served = load_checkpoint(SMOLLM2)
    reference = float32_reference(SMOLLM2)
    assert served.model.layers[0].mlp.gate_up.weight.is_meta
    code = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    tokens = served.tokenizer.encode(code).ids
    logits = []
    for model in (served.model, reference.model):
        cache = model.new_cache(1, 64)
        cache.allocate()
        logits.append(forward(model, cache, tokens))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


@needs_smollm2
def test_the_published_q4_1_model_is_resident_in_at_most_one_and_a_half_times_its_file():
    """Measured in a process of its own, after the interpreter, torch and the kernels are loaded:
    the private memory loading the model adds (its panels, tokenizer and allocator slack; the
    float32 dequantized model takes 11 times the file). Shared libraries' pages that the load's
    code first touches are not the model's and not counted (about 13 MB more)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--json", str(SMOLLM2)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.splitlines()[-1])
    assert measured["loaded_private_bytes"] <= 1.5 * SMOLLM2.stat().st_size, measured
