"""The compiled CPU forward (engine/native/kernels.c): a token's logits are the same bits whatever shares its
forward, the library is built once per machine, and without a compiler models fall back to PyTorch
operators. Its agreement with transformers on every family is in tests/test_parity.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.checkpoint import load_checkpoint, use_native
from engine.model.transformer import Captured, ForwardBatch, side_by_side
from engine.native.build import library, problem
from engine.native.forward import NativeForward
from engine.native.weights import int8_rows
from tests.conftest import DEFAULT_DRAFT, DEFAULT_TARGET, ROOT, save_tiny, tiny_hf_model

pytestmark = pytest.mark.skipif(library() is None, reason=f"no compiled kernels: {problem()}")


@pytest.fixture(scope="module")
def target():
    return load_checkpoint(DEFAULT_TARGET)


def forward(model, cache, slots, tokens, **kwargs):
    return model(ForwardBatch.build(cache, slots, tokens, model.config.sliding_window), cache, **kwargs)


@torch.inference_mode()
def test_a_verify_gives_the_logits_of_one_token_at_a_time_bit_for_bit(target):
    model = target.model
    assert model.native is not None
    cache = model.new_cache(1, 256)
    slot = cache.allocate()
    prompt = list(range(10, 150))
    forward(model, cache, [slot], [prompt], last_only=True)
    drafts = [17, 400, 2, 3001, 77, 5]
    verified = forward(model, cache, [slot], [drafts]).logits[0]
    cache.truncate(slot, len(prompt))
    one_by_one = torch.stack([forward(model, cache, [slot], [[token]]).logits[0, 0] for token in drafts])
    assert torch.equal(verified, one_by_one)


@torch.inference_mode()
def test_a_rows_logits_do_not_depend_on_the_rest_of_its_batch(target):
    model = target.model
    prompts = [list(range(5, 5 + n)) for n in (90, 13, 200, 41)]
    alone_cache, together_cache = model.new_cache(4, 512), model.new_cache(4, 512)
    slots = [together_cache.allocate() for _ in prompts]
    together = forward(model, together_cache, slots, prompts, last_only=True).logits
    steps = [[3, 4, 5], [6], [7, 8, 9, 10, 11, 12, 13], [14, 15]]
    together_step = forward(model, together_cache, slots, steps).logits
    for row, (prompt, step) in enumerate(zip(prompts, steps)):
        slot = alone_cache.allocate()
        alone = forward(model, alone_cache, [slot], [prompt], last_only=True).logits
        assert torch.equal(alone[0], together[row])
        alone_step = forward(model, alone_cache, [slot], [step]).logits
        assert torch.equal(alone_step[0], together_step[row, : len(step)])
        assert not together_step[row, len(step) :].any()  # padded places stay zero


@torch.inference_mode()
def test_a_bfloat16_checkpoint_is_served_in_bfloat16_with_float32s_logits_bit_for_bit(target, tmp_path):
    """The default models are stored in bfloat16: dtype "auto" keeps them so on a CPU, and widened
    as they are read they give exactly the float32 forward's logits, at half the bytes; a verify is
    still exact. A checkpoint stored in float32 stays float32."""
    served = load_checkpoint(DEFAULT_TARGET, dtype="auto")
    model = served.model
    assert model.native is not None and model.embed_tokens.weight.dtype == torch.bfloat16
    assert target.model.embed_tokens.weight.dtype == torch.float32  # no dtype given: float32 on a CPU
    prompt, drafts = list(range(40, 200)), [9, 8, 7, 6]
    caches = [m.new_cache(1, 256) for m in (target.model, model)]
    for cache in caches:
        cache.allocate()
    logits = [forward(m, c, [0], [prompt + drafts]).logits[0] for m, c in zip((target.model, model), caches)]
    assert torch.equal(logits[1], logits[0])
    cache = caches[1]
    cache.truncate(0, len(prompt))
    verified = forward(model, cache, [0], [drafts]).logits[0]
    cache.truncate(0, len(prompt))
    assert torch.equal(verified, torch.stack([forward(model, cache, [0], [[t]]).logits[0, 0] for t in drafts]))
    stored_float32 = save_tiny(tiny_hf_model("llama"), tmp_path / "f32")
    assert load_checkpoint(stored_float32, dtype="auto").model.embed_tokens.weight.dtype == torch.float32


@torch.inference_mode()
def test_int8_weights_serve_the_logits_of_their_dequantized_values_at_a_quarter_of_the_bytes():
    """A drafter's linear weights stored as int8 with a scale per output: the forward gives the
    logits of the float32 weights those values stand for, but for the order of operations, and a
    verify (wide enough that its panels are widened once) is still exact."""
    draft = load_checkpoint(DEFAULT_DRAFT, dtype="float32")
    lib = library()
    int8 = NativeForward(draft.model, lib, linears=torch.int8)
    assert all(p.dtype in (torch.int8, torch.float32) for p in int8.weights.kept)
    linear_bytes = sum(p.numel() for p in int8.weights.kept if p.dtype == torch.int8)
    assert linear_bytes * 4 == sum(p.numel() * 4 for p in draft.model.native.weights.kept if p.dim() == 3)
    reference = load_checkpoint(DEFAULT_DRAFT, dtype="float32", native_forward=False).model
    reference.lm_head = torch.nn.Linear(reference.config.hidden_size, reference.config.vocab_size, bias=False)
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear):
            source = draft.model.embed_tokens if name == "lm_head" else draft.model.get_submodule(name)
            values, scale = int8_rows(source.weight)
            assert values.dtype == torch.int8 and values.abs().amax() == 127
            module.weight = torch.nn.Parameter(values.float() * scale[:, None])
            module.packed = None  # packed from the weight it replaces
    prompt, drafts = list(range(40, 200)), [9, 8, 7, 6]
    served = draft.model
    served.native = int8
    caches = [m.new_cache(1, 256) for m in (reference, served)]
    for cache in caches:
        cache.allocate()
    logits = [forward(m, c, [0], [prompt + drafts]).logits[0] for m, c in zip((reference, served), caches)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    cache = caches[1]
    cache.truncate(0, len(prompt))
    verified = forward(served, cache, [0], [drafts]).logits[0]
    cache.truncate(0, len(prompt))
    assert torch.equal(verified, torch.stack([forward(served, cache, [0], [[t]]).logits[0, 0] for t in drafts]))
    cache.truncate(0, 0)
    prefill = forward(served, cache, [0], [prompt], last_only=True).logits[0, 0]  # panels widened
    cache.truncate(0, len(prompt) - 1)
    assert torch.equal(prefill, forward(served, cache, [0], [prompt[-1:]]).logits[0, 0])


@pytest.mark.parametrize("kind, bytes_per_weight", [("int8", 1), ("int4", 0.5)])
@torch.inference_mode()
def test_int8_and_int4_groups_give_the_float32_forward_of_their_values_and_verify_exactly(kind, bytes_per_weight):
    """engine.weights quantizes the target's linear layers (the tied lm head too) in groups of 32:
    panels of a byte or half a byte a weight, and the logits of the float32 weights those groups
    stand for: bit for bit those of the compiled float32 forward (prompts whose panels are widened
    once, verifies and decode steps read as stored), within 1e-5 of the logits' scale of PyTorch's;
    a verify still gives its decode steps' logits bit for bit."""
    served = load_checkpoint(DEFAULT_TARGET, weights=kind).model
    assert served.native is not None and served.lm_head.quantized is not None
    stored = sum(p.numel() for p in served.native.weights.kept if p.dtype in (torch.int8, torch.uint8))
    layers = {id(m.quantized): m.weight.numel() for m in served.modules() if getattr(m, "quantized", None) is not None}
    linears = sum(layers.values())  # the tied embedding is the lm head's panels
    assert stored == pytest.approx(linears * bytes_per_weight, rel=0.01)  # gate/up's padding aside
    assert served.lm_head.weight.is_meta  # kept only in the panels
    operators = load_checkpoint(DEFAULT_TARGET, weights=kind, native_forward=False).model  # their float32 values
    plain = load_checkpoint(DEFAULT_TARGET, dtype="float32").model
    plain.load_state_dict(operators.state_dict())  # the dequantized values, as float32 panels
    assert served.lm_head.quantized is not None and plain.native is None and use_native(plain)
    prompt, drafts = list(range(40, 200)), [9, 8, 7, 6]
    caches = [m.new_cache(1, 256) for m in (served, plain, operators)]
    for cache in caches:
        cache.allocate()
    prefill = [forward(m, c, [0], [prompt]).logits[0] for m, c in zip((served, plain, operators), caches)]
    verify = [forward(m, c, [0], [drafts]).logits[0] for m, c in zip((served, plain, operators), caches)]
    for logits in (prefill, verify):
        assert torch.equal(logits[0], logits[1])
        assert (logits[0] - logits[2]).abs().max() <= 1e-5 * logits[2].abs().max()
    cache = caches[0]
    cache.truncate(0, len(prompt))
    assert torch.equal(verify[0], torch.stack([forward(served, cache, [0], [[t]]).logits[0, 0] for t in drafts]))


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_library_is_built_once_into_the_cache_directory_and_the_build_is_logged_before_it_runs(tmp_path):
    code = (
        "import logging; logging.basicConfig(level=logging.INFO); "
        "from engine.native.build import library, problem; lib = library(); print(lib is not None, problem())"
    )
    first = run_python(code, ADASPEC_CACHE_DIR=str(tmp_path))
    assert first.stdout.split()[0] == "True", first.stderr
    [built] = tmp_path.glob("kernels-*.so")
    assert "compiling the CPU kernels" in first.stderr and str(built) in first.stderr
    stamp = built.stat().st_mtime_ns
    again = run_python(code, ADASPEC_CACHE_DIR=str(tmp_path))
    assert again.stdout.split()[0] == "True", again.stderr
    assert "compiling" not in again.stderr  # the cached library is loaded, nothing compiled
    assert [p.name for p in tmp_path.iterdir()] == [built.name] and built.stat().st_mtime_ns == stamp


def test_a_first_start_compiles_the_kernels_as_a_phase_of_its_own(tmp_path):
    """Start-up names the compile as its phase (the compiler and the library it writes) before the
    models load; a start that finds the library cached goes straight to loading them."""
    code = (
        "import contextlib; from control.load import load_config; from control.assemble import load_models\n"
        "names = []\n"
        "@contextlib.contextmanager\n"
        "def phase(name):\n    names.append(name)\n    yield\n"
        "load_models(load_config('config.toml'), phase); print(names[0])"
    )
    first = run_python(code, ADASPEC_CACHE_DIR=str(tmp_path))
    [built] = tmp_path.glob("kernels-*.so")
    assert first.stdout.strip().startswith("compile the CPU kernels: ") and str(built) in first.stdout, first.stderr
    again = run_python(code, ADASPEC_CACHE_DIR=str(tmp_path))
    assert again.stdout.strip().startswith("load target "), again.stderr


@pytest.mark.parametrize("env", [{"CC": "false"}, {"ADASPEC_NATIVE": "0"}], ids=["no compiler", "disabled"])
def test_without_the_kernels_models_run_on_pytorch_operators(tmp_path, env):
    path = save_tiny(tiny_hf_model("llama", vocab_size=64), tmp_path / "tiny")
    code = (
        "from engine.checkpoint import load_checkpoint; from engine.generate import generate; "
        "from engine.sampling import SamplingParams; "
        f"c = load_checkpoint({str(path)!r}); "
        "out = generate(c, [[3, 4, 5]], SamplingParams(max_tokens=8, temperature=0)); "
        "print(c.model.native is None, len(out[0].tokens))"
    )
    done = run_python(code, ADASPEC_CACHE_DIR=str(tmp_path / "cache"), **env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "8"]
    if "CC" in env:
        assert "compiled CPU kernels are unavailable (the C compiler 'false' does not run" in done.stderr
    assert not list(Path(tmp_path / "cache").glob("*.so"))


@torch.inference_mode()
def test_captured_layers_come_side_by_side_in_one_tensor_as_the_operators_compute_them(target, monkeypatch):
    """A ragged verify capturing taps (one repeated) writes them into one tensor, each layer's entry
    a view of it; `side_by_side` hands that tensor over without a copy, and its values are the
    PyTorch operators' own (padding rows zero); keeping some rows keeps them side by side."""
    model = target.model
    prompts, steps, taps = [list(range(10, 70)), list(range(5, 30))], [[3, 4, 5, 6], [7]], (1, 4, 4, 6)
    captured = {}
    for name in ("compiled", "operators"):
        if name == "operators":
            monkeypatch.setattr(model, "native", None)
        cache = model.new_cache(2, 128)
        slots = [cache.allocate() for _ in prompts]
        forward(model, cache, slots, prompts, last_only=True)
        captured[name] = forward(model, cache, slots, steps, capture=taps).hidden
    compiled, operators = captured["compiled"], captured["operators"]
    assert isinstance(compiled, Captured) and compiled.layers == (1, 4, 6)
    joined = side_by_side(compiled, (1, 4, 6))
    assert joined.data_ptr() == compiled[1].data_ptr() and joined.shape == (2, 4, 3 * model.config.hidden_size)
    expected = torch.cat([operators[i] for i in (1, 4, 6)], dim=-1)
    torch.testing.assert_close(joined[0], expected[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(joined[1, :1], expected[1, :1], atol=1e-4, rtol=0)
    assert not joined[1, 1:].any()  # past the short row's one token
    repeated = side_by_side(compiled, taps)  # not the order written: a copy, as the drafter asked
    width = model.config.hidden_size
    assert repeated.data_ptr() != joined.data_ptr() and torch.equal(repeated[..., -width:], joined[..., -width:])
    kept = compiled.rows(torch.tensor([1]))
    assert torch.equal(side_by_side(kept, (1, 4, 6)), joined[1:])


@torch.inference_mode()
def test_the_forward_hands_greedy_verification_each_rows_argmax(target):
    """The compiled forward computes the argmax greedy verification reads, as torch.argmax would
    over its logits: a ragged batch (padding places' zero logits give 0) and last-token logits."""
    model = target.model
    cache = model.new_cache(3, 256)
    slots = [cache.allocate() for _ in range(3)]
    prompts = [list(range(10, 10 + n)) for n in (40, 7, 90)]
    first = forward(model, cache, slots, prompts, last_only=True)
    assert first.argmax is not None and torch.equal(first.argmax, first.logits.argmax(dim=-1))
    out = forward(model, cache, slots, [[3, 4, 5, 6, 7, 8], [9], [10, 11, 12]])
    assert out.argmax.shape == (3, 6) and torch.equal(out.argmax, out.logits.argmax(dim=-1))
    assert not out.argmax[1, 1:].any()  # padding


@torch.inference_mode()
def test_a_prefill_finishes_only_the_rows_it_returns_with_the_logits_and_cache_of_finishing_all(target):
    """The last layer's attention, MLP and norm run only for the tokens whose logits are wanted
    (a prefill's last): their logits, every cache entry and the next step are those of a forward
    that finishes every token."""
    model = target.model
    prompts = [list(range(7, 7 + n)) for n in (120, 1, 37)]
    short, full = model.new_cache(3, 256), model.new_cache(3, 256)
    slots = [short.allocate() for _ in prompts]
    assert slots == [full.allocate() for _ in prompts]
    last = forward(model, short, slots, prompts, last_only=True).logits[:, 0]
    every = forward(model, full, slots, prompts).logits
    for row, prompt in enumerate(prompts):
        assert torch.equal(last[row], every[row, len(prompt) - 1])
    assert torch.equal(short.k, full.k) and torch.equal(short.v, full.v)
    step = [[5], [6, 7], [8]]
    assert torch.equal(forward(model, short, slots, step).logits, forward(model, full, slots, step).logits)


@torch.inference_mode()
def test_a_sliding_window_past_whole_key_panels_gives_the_operators_logits_and_a_verify_its_steps(tmp_path):
    """Keys before every query's window are skipped whole panels at a time: past 64 + window
    positions the logits still match PyTorch operators' masked attention, and a verify still
    gives each token's decode logits bit for bit."""
    path = save_tiny(tiny_hf_model("mistral", vocab_size=64, sliding_window=20), tmp_path / "mistral")
    compiled, plain = (load_checkpoint(path, native_forward=native).model for native in (True, False))
    assert compiled.native is not None and plain.native is None
    prompt, drafts = [(7 * i) % 61 + 1 for i in range(150)], [3, 9, 27, 17, 51]
    logits = []
    for model in (compiled, plain):
        cache = model.new_cache(1, 256)
        slot = cache.allocate()
        forward(model, cache, [slot], [prompt], last_only=True)
        logits.append(forward(model, cache, [slot], [drafts]).logits[0])
        if model is compiled:
            cache.truncate(slot, len(prompt))
            steps = torch.stack([forward(model, cache, [slot], [[token]]).logits[0, 0] for token in drafts])
            assert torch.equal(logits[0], steps)
    assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_the_structures_python_reads_from_the_header_are_laid_out_as_the_compiler_lays_them(tmp_path):
    """engine/native/abi.py makes its ctypes structures from kernels.h: every field sits at the
    offset, and every structure has the size, that the C compiler gives them."""
    import ctypes
    import shutil

    from engine.native.abi import HEADER, STRUCTS

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    lines = [f'#include "{HEADER}"', "#include <stddef.h>", "#include <stdio.h>", "int main(void) {"]
    for name, struct in STRUCTS.items():
        lines.append(f'    printf("{name} %zu\\n", sizeof({name}));')
        for field, _ in struct._fields_:
            lines.append(f'    printf("{name}.{field} %zu\\n", offsetof({name}, {field}));')
    (tmp_path / "layout.c").write_text("\n".join([*lines, "    return 0;", "}"]) + "\n")
    subprocess.run([compiler, "-o", str(tmp_path / "layout"), str(tmp_path / "layout.c")], check=True)
    printed = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout
    expected = {}
    for name, struct in STRUCTS.items():
        expected[name] = ctypes.sizeof(struct)
        for field, _ in struct._fields_:
            expected[f"{name}.{field}"] = getattr(struct, field).offset
    assert dict((key, int(value)) for key, value in (line.split() for line in printed.splitlines())) == expected
    assert {"Linear", "Layer", "Model", "Cache", "Batch", "Context"} <= set(STRUCTS)


def test_every_function_the_header_declares_gets_its_argument_types():
    from engine.native.abi import FUNCTIONS

    lib = library()
    declared = {"adaspec_forward": 3, "adaspec_eagle3_chain": 19, "adaspec_nucleus": 5}
    assert {name: len(FUNCTIONS[name]) for name in declared} == declared
    for name, argtypes in FUNCTIONS.items():
        assert getattr(lib, name).argtypes == argtypes
