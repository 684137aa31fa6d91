"""GGUF checkpoints: the same model, tokenizer, EOS ids and chat template as the checkpoint
directory they were written from; clear errors for files that cannot be served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch

from bench.published import SMOLLM2
from control.issues import ConfigError
from control.load import load_config
from engine.chat_template import ChatTemplate
from engine.checkpoint import load_checkpoint
from engine.generate import generate
from engine.gguf import GGUFCheckpoint, inspect_gguf
from engine.model.config import CheckpointError
from engine.model.transformer import ForwardBatch
from engine.sampling import SamplingParams
from tests.conftest import DEFAULT_TARGET, needs_smollm2, tiny_hf_model
from tests.gguf_files import CHAT_TEMPLATE, dequantized_copy, write_gguf

Q = gguf.GGMLQuantizationType
PROMPTS = ["def add(a, b):\n    return", "The capital of France is", "for i in range(10):"]
TEXTS = [*PROMPTS, "naïve café: 日本語 🙂 — ok?", "x = [1, 22, 333]  # numbers\n\n\tindent", "<|endoftext|>after"]


def greedy(checkpoint, prompts=PROMPTS, tokens: int = 24) -> list[list[int]]:
    encoded = [checkpoint.tokenizer.encode(p).ids for p in prompts]
    done = generate(checkpoint, encoded, SamplingParams(temperature=0.0, max_tokens=tokens))
    return [c.tokens for c in done]


def logits_of(checkpoint, tokens: list[int]) -> torch.Tensor:
    cache = checkpoint.model.new_cache(1, 64)
    return checkpoint.model(ForwardBatch.build(cache, [cache.allocate()], [tokens]), cache).logits


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def reference():
    return load_checkpoint(DEFAULT_TARGET)


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.Q8_0])
def test_greedy_output_is_the_safetensors_model_s_on_the_weights_the_file_holds(files, reference, kind):
    loaded = load_checkpoint(write_gguf(DEFAULT_TARGET, files / f"target-{kind.name}.gguf", kind))
    # F32 holds the checkpoint's weights exactly; F16 and Q8_0 hold what storing them made of them.
    same = reference if kind == Q.F32 else load_checkpoint(dequantized_copy(DEFAULT_TARGET, files / kind.name, kind))
    assert loaded.config == same.config
    assert greedy(loaded) == greedy(same)
    tokens = loaded.tokenizer.encode(PROMPTS[0]).ids
    torch.testing.assert_close(logits_of(loaded, tokens), logits_of(same, tokens), atol=0, rtol=0)


def test_a_quantized_file_is_not_the_float_model(files, reference):
    """Q8_0 changes the weights: the comparison above is against them, not the originals."""
    loaded = load_checkpoint(write_gguf(DEFAULT_TARGET, files / "q8.gguf", Q.Q8_0))
    tokens = loaded.tokenizer.encode(PROMPTS[1]).ids
    assert not torch.equal(logits_of(loaded, tokens), logits_of(reference, tokens))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_each_architecture_loads_as_its_checkpoint_directory(tmp_path, family):
    """qwen2's q/k/v biases and qwen3's q/k norms come through, neither has llama's row order,
    and a separate output head is read as such."""
    model = tiny_hf_model(family, vocab_size=8192, tie_word_embeddings=False)
    directory = tmp_path / family
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(DEFAULT_TARGET / name, directory / name)
    loaded = load_checkpoint(write_gguf(directory, tmp_path / f"{family}.gguf"))
    same = load_checkpoint(directory)
    assert loaded.config == same.config and not loaded.config.tie_word_embeddings
    tokens = loaded.tokenizer.encode(PROMPTS[2]).ids
    torch.testing.assert_close(logits_of(loaded, tokens), logits_of(same, tokens), atol=0, rtol=0)


def test_tokenizer_eos_and_chat_template_come_from_the_file(files, reference):
    path = write_gguf(DEFAULT_TARGET, files / "tokenizer.gguf")
    loaded = load_checkpoint(path)
    for text in TEXTS:
        ids = reference.tokenizer.encode(text).ids
        assert loaded.tokenizer.encode(text).ids == ids, text
        assert loaded.tokenizer.decode(ids) == reference.tokenizer.decode(ids)
    assert loaded.eos_token_ids == reference.eos_token_ids == {0}
    template = ChatTemplate.from_checkpoint(path)
    assert template.source == CHAT_TEMPLATE
    rendered = template.render([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert template.special_tokens["eos_token"] == "<|endoftext|>"


def test_a_file_without_a_chat_template_gets_the_plain_fallback(files):
    template = ChatTemplate.from_checkpoint(write_gguf(DEFAULT_TARGET, files / "plain.gguf", chat_template=None))
    assert template.source is None and template.render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant: "


def test_raw_tensors_are_the_stored_blocks_and_dequantize_separately(files):
    """What quantized kernels will take: each weight's type and blocks as stored, rows in order."""
    checkpoint = GGUFCheckpoint(write_gguf(DEFAULT_TARGET, files / "raw.gguf", Q.Q8_0))
    raw = dict(checkpoint.raw_tensors())
    q = raw["model.layers.0.self_attn.q_proj.weight"]
    assert q.type == Q.Q8_0 and q.shape == (384, 384) and q.data.dtype.name == "uint8"
    assert q.data.shape == (384, 384 // 32 * 34)  # 32 int8 and one fp16 scale per block
    assert raw["model.norm.weight"].type == Q.F32
    assert checkpoint.stored_types() == {"F32", "Q8_0"}


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def bad_files(root: Path) -> dict[str, tuple[Path, str]]:
    """Files a user might point the config at, and what the one-line error must say."""
    good = write_gguf(DEFAULT_TARGET, root / "good.gguf", Q.Q8_0).read_bytes()
    i32 = {"blk.0.attn_norm.weight": Q.I32}
    return {
        "text": (write_bytes(root / "notes.gguf", b"just some text\n"), "not a GGUF file"),
        "empty": (write_bytes(root / "empty.gguf", b""), "not a GGUF file (it is empty)"),
        "truncated": (write_bytes(root / "cut.gguf", good[: len(good) // 2]), "a GGUF file cut short"),
        "header only": (write_bytes(root / "head.gguf", good[:64]), "a GGUF file cut short"),
        "architecture": (
            write_gguf(DEFAULT_TARGET, root / "phi.gguf", architecture="phi2"),
            "unsupported architecture 'phi2'; supported: llama, qwen2, qwen3",
        ),
        "tensor type": (
            write_gguf(DEFAULT_TARGET, root / "i32.gguf", types=i32),
            "unsupported tensor type I32 in a llama model",
        ),
        "missing tensor": (
            write_gguf(DEFAULT_TARGET, root / "short.gguf", leave_out="blk.1.ffn_up.weight"),
            "missing tensor 'model.layers.1.mlp.up_proj.weight'",
        ),
        "pre-tokenizer": (
            write_gguf(DEFAULT_TARGET, root / "pre.gguf", pre="chameleon"),
            "pre-tokenizer 'chameleon' is not supported",
        ),
    }


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    return bad_files(tmp_path_factory.mktemp("bad"))


@pytest.mark.parametrize(
    "case",
    ["text", "empty", "truncated", "header only", "architecture", "tensor type", "missing tensor", "pre-tokenizer"],
)
def test_a_bad_file_is_one_line_naming_the_file_and_the_fault(bad, case):
    path, fault = bad[case]
    for read in (load_checkpoint, inspect_gguf):
        with pytest.raises(CheckpointError) as caught:
            read(path)
        message = str(caught.value)
        assert message.startswith(f"{path}: ") and fault in message and "\n" not in message, message


def test_the_config_check_reads_a_gguf_as_it_reads_a_directory(tmp_path, bad):
    target = write_gguf(DEFAULT_TARGET, tmp_path / "target.gguf", Q.Q8_0)
    draft = write_gguf(DEFAULT_TARGET, tmp_path / "draft.gguf", Q.F16)
    config = tmp_path / "config.toml"
    config.write_text(f'[engine]\ntarget = "{target}"\ndrafter = "draft_model"\ndraft = "{draft}"\n')
    assert load_config(config, check_models=True).engine.target == target
    for case in ("truncated", "architecture", "tensor type", "missing tensor"):
        path, fault = bad[case]
        config.write_text(f'[engine]\ntarget = "{path}"\ndrafter = "ngram"\n')
        with pytest.raises(ConfigError) as caught:
            load_config(config, check_models=True)
        [issue] = caught.value.issues
        assert issue.path == "engine.target" and fault in issue.message and str(path) in issue.message


def test_a_draft_gguf_must_share_the_targets_tokenizer(tmp_path):
    model = tiny_hf_model("llama", vocab_size=8192)
    other = tmp_path / "other"
    model.save_pretrained(other)
    shutil.copy(DEFAULT_TARGET / "generation_config.json", other)
    # The same tokens, two of them under each other's id: the check compares ids, not counts.
    tokenizer = json.loads((DEFAULT_TARGET / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġa"] = vocab["Ġa"], vocab["Ġthe"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    draft = write_gguf(other, tmp_path / "draft.gguf")
    config = tmp_path / "config.toml"
    config.write_text(f'[engine]\ntarget = "{DEFAULT_TARGET}"\ndrafter = "draft_model"\ndraft = "{draft}"\n')
    with pytest.raises(ConfigError, match="does not share the target's tokenizer"):
        load_config(config, check_models=True)


@needs_smollm2
def test_a_published_q4_1_model_reads_as_transformers_reads_it(tmp_path):
    """Against transformers' reading of the same file (its dequantization, shape and tokenizer,
    written as a checkpoint directory by tools/dequantize_gguf.py), run on the same forward."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers reads a GGUF only with accelerate")
    from tools.dequantize_gguf import dequantize

    dequantize(SMOLLM2, tmp_path / "smollm2", torch.float32)
    theirs = load_checkpoint(tmp_path / "smollm2")
    ours = load_checkpoint(SMOLLM2)
    assert (ours.config.num_layers, ours.config.hidden_size, ours.config.vocab_size) == (30, 576, 49152)
    code = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    for text in [code, "Grüße aus Köln — 東京 🙂", "x = 12345 * 3.14", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert ours.tokenizer.encode(text).ids == theirs.tokenizer.encode(text).ids, text
    tokens = ours.tokenizer.encode(code).ids
    torch.testing.assert_close(logits_of(ours, tokens), logits_of(theirs, tokens), atol=1e-5, rtol=0)
    assert greedy(ours, [code], 16) == greedy(theirs, [code], 16)
    assert ours.eos_token_ids == {2}
    assert (
        ChatTemplate.from_checkpoint(SMOLLM2)
        .render([{"role": "user", "content": "hi"}])
        .startswith("<|im_start|>system\n")
    )
