from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.published import SMOLLM2

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = ROOT / "models" / "target"
DEFAULT_DRAFT = ROOT / "models" / "draft"
# The published model's GGUF (bench/published.py): CI fetches it (.ci/run); elsewhere its tests
# run where the file is.
needs_smollm2 = pytest.mark.skipif(not SMOLLM2.is_file(), reason=f"{SMOLLM2} absent (set ADASPEC_SMOLLM2_GGUF)")


def tiny_hf_model(family: str, vocab_size: int = 96, seed: int = 0, **overrides):
    """A random transformers model of `family` small enough for exact tests."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_class, model_class = classes[family]
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
    )
    if family == "qwen3":
        settings["head_dim"] = 24  # Qwen3 sets head_dim independently of hidden/heads
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_class(config_class(**settings)).eval()
    # Non-trivial norm weights and biases, so that a mis-loaded one shows in the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))


def save_tiny(model, path: Path, **save_kwargs) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **save_kwargs)
    write_word_tokenizer(path, model.config.vocab_size)
    return path


def perturbed_copy(source: Path, destination: Path, scale: float, seed: int = 1) -> Path:
    """A copy of checkpoint `source` with noise on every weight: a draft that agrees with it
    often, but not always."""
    from safetensors.torch import load_file, save_file

    destination.mkdir()
    for item in source.iterdir():
        (destination / item.name).write_bytes(item.read_bytes())
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(source / "model.safetensors")
    noisy = {name: t + scale * torch.randn(t.shape, generator=generator) * t.std() for name, t in tensors.items()}
    save_file(noisy, destination / "model.safetensors")
    return destination


def tiny_pair(root: Path, native_forward: bool = True):
    """A tiny target and a draft that mostly agrees with it, loaded from checkpoints under `root`."""
    from engine.checkpoint import load_checkpoint

    target_dir = save_tiny(tiny_hf_model("llama", vocab_size=64), root / "target")
    draft_dir = perturbed_copy(target_dir, root / "draft", scale=0.2)
    return load_checkpoint(target_dir, native_forward=native_forward), load_checkpoint(
        draft_dir, native_forward=native_forward
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a draft that mostly agrees with it."""
    return tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    """A target over 8 tokens and a draft far from it: sampled outputs can be checked exactly."""
    from engine.checkpoint import load_checkpoint

    root = tmp_path_factory.mktemp("tiny_vocab")
    target_dir = save_tiny(tiny_hf_model("qwen2", vocab_size=8, initializer_range=0.3), root / "target")
    draft_dir = perturbed_copy(target_dir, root / "draft", scale=1.0)
    return load_checkpoint(target_dir), load_checkpoint(draft_dir)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny Llama with a vocabulary of 64, loaded from safetensors."""
    from engine.checkpoint import load_checkpoint

    return load_checkpoint(save_tiny(tiny_hf_model("llama", vocab_size=64), tmp_path_factory.mktemp("tiny")))


def forward_one(model, cache, slot, tokens):
    """The logits of every token in `tokens`, fed to one cache slot."""
    from engine.model.transformer import ForwardBatch

    return model(ForwardBatch.build(cache, [slot], [tokens]), cache).logits[0]
