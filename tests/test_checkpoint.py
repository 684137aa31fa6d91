"""Loading checkpoints: sharded files, and clear errors for what cannot be loaded."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.device.resolve import DeviceError, resolve_device
from engine.generate import main as generate_main
from engine.model.config import CheckpointError, inspect_checkpoint
from engine.model.transformer import ForwardBatch, Linear
from engine.native.build import library, problem
from tests.conftest import DEFAULT_TARGET, save_tiny, tiny_hf_model


@pytest.fixture
def tiny_dir(tmp_path):
    return save_tiny(tiny_hf_model("llama"), tmp_path / "tiny")


def logits_of(checkpoint, tokens):
    cache = checkpoint.model.new_cache(1, 32)
    slot = cache.allocate()
    return checkpoint.model(ForwardBatch.build(cache, [slot], [tokens]), cache).logits


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    reference = tiny_hf_model("qwen2")
    single = load_checkpoint(save_tiny(reference, tmp_path / "single"))
    sharded_dir = save_tiny(reference, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded_dir / "model.safetensors.index.json").exists()
    sharded = load_checkpoint(sharded_dir)
    torch.testing.assert_close(logits_of(sharded, [3, 4, 5]), logits_of(single, [3, 4, 5]), atol=0, rtol=0)


def test_eos_ids_come_from_generation_config(tiny_dir):
    (tiny_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    assert load_checkpoint(tiny_dir).eos_token_ids == {1, 7}


def test_unsupported_architecture_is_named(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tiny_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported architecture.*GPT2LMHeadModel"):
        load_checkpoint(tiny_dir)


def test_missing_tensor_is_named(tiny_dir):
    tensors = load_file(tiny_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tiny_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_checkpoint(tiny_dir)


def test_unexpected_tensor_is_named_with_its_file(tiny_dir):
    tensors = load_file(tiny_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, tiny_dir / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn\.extra"
    ):
        load_checkpoint(tiny_dir)


def test_wrong_shape_is_named_with_both_shapes(tiny_dir):
    tensors = load_file(tiny_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, tiny_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(8, 64\), expected \(32, 64\)"):
        load_checkpoint(tiny_dir)


def test_missing_directory_and_tokenizer(tmp_path, tiny_dir):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "nowhere")
    (tiny_dir / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not found"):
        load_checkpoint(tiny_dir)


def test_a_weights_file_cut_short_is_named_before_anything_loads(tiny_dir):
    weights = tiny_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a copy that stopped early
    for read in (load_checkpoint, inspect_checkpoint):
        with pytest.raises(
            CheckpointError, match=r"model\.safetensors: not a readable safetensors file \(.*not fully covered"
        ):
            read(tiny_dir)


def test_save_then_load_round_trips_in_bf16(tmp_path, tiny_dir):
    checkpoint = load_checkpoint(tiny_dir)
    raw = json.loads((tiny_dir / "config.json").read_text())
    save_checkpoint(checkpoint.model, tmp_path / "copy", raw, checkpoint.tokenizer, dtype=torch.bfloat16)
    copy = load_checkpoint(tmp_path / "copy")
    assert load_file(tmp_path / "copy" / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(logits_of(copy, [3, 4]), logits_of(checkpoint, [3, 4]), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("native_forward", [True, False], ids=["compiled", "pytorch"])
def test_the_model_runs_in_the_dtype_asked_for(tiny_dir, native_forward):
    bf16 = load_checkpoint(tiny_dir, dtype="bfloat16", native_forward=native_forward)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    logits = logits_of(bf16, [3, 4, 5])
    # The compiled forward widens bfloat16 weights and computes in float32; PyTorch's in bfloat16.
    compiled = bf16.model.native is not None
    assert compiled == (native_forward and library() is not None)
    assert logits.dtype == (torch.float32 if compiled else torch.bfloat16)
    torch.testing.assert_close(logits.float(), logits_of(load_checkpoint(tiny_dir), [3, 4, 5]), atol=0.05, rtol=0.05)


def test_npu_without_torch_npu_is_a_clear_error():
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(DeviceError, match="torch_npu"):
            resolve_device("npu")
    else:
        pytest.skip("torch_npu is installed")


def test_unknown_device_is_rejected():
    with pytest.raises(DeviceError, match="unknown device 'tpu'"):
        resolve_device("tpu")


@pytest.mark.skipif(library() is None, reason=f"no compiled kernels: {problem()}")
def test_cpu_float32_checkpoints_run_the_compiled_forward_with_the_same_logits(tiny_dir):
    checkpoint = load_checkpoint(tiny_dir)
    assert checkpoint.model.native is not None
    compiled = logits_of(checkpoint, [3, 4, 5, 6])
    checkpoint.model.to(torch.float32)  # any conversion drops the compiled forward ...
    assert checkpoint.model.native is None
    torch.testing.assert_close(logits_of(checkpoint, [3, 4, 5, 6]), compiled, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_checkpoints_run_from_packed_weights_with_the_same_logits(tiny_dir, dtype):
    if dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bfloat16 instructions for oneDNN")
    checkpoint = load_checkpoint(tiny_dir, dtype=dtype, native_forward=False)
    linears = [m for m in checkpoint.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    packed = logits_of(checkpoint, [3, 4, 5, 6])
    checkpoint.model.to(getattr(torch, dtype))  # any conversion drops the packed copies ...
    assert all(m.packed is None for m in linears)
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(logits_of(checkpoint, [3, 4, 5, 6]), packed, atol=tolerance, rtol=tolerance)


def test_loading_new_weights_drops_the_stale_packed_copy(tiny_dir, tmp_path):
    checkpoint = load_checkpoint(tiny_dir)
    other = load_checkpoint(save_tiny(tiny_hf_model("llama", seed=1), tmp_path / "other"))
    checkpoint.model.load_state_dict(other.model.state_dict())
    assert checkpoint.model.native is None
    assert all(m.packed is None for m in checkpoint.model.modules() if isinstance(m, Linear))
    torch.testing.assert_close(logits_of(checkpoint, [3, 4, 5]), logits_of(other, [3, 4, 5]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--model", "/nonexistent", "x"], "/nonexistent: not a checkpoint directory"),
        (["--dtype", "fp8", "x"], "unknown dtype 'fp8'"),
        (["--top-p", "2", "x"], "top_p must be in (0, 1]"),
        (["--model", str(DEFAULT_TARGET), "--max-tokens", "5000", "x"], "need 5001 positions; the model has 2048"),
    ],
)
def test_the_generate_command_says_what_is_wrong_in_a_line(argv, says, capsys):
    with pytest.raises(SystemExit) as stopped:
        generate_main(argv)
    said = str(stopped.value.code) if isinstance(stopped.value.code, str) else capsys.readouterr().err
    assert stopped.value.code != 0 and says in said and "Traceback" not in said


def test_a_corrupt_tokenizer_is_a_checkpoint_error_naming_the_file(tiny_dir):
    (tiny_dir / "tokenizer.json").write_text('{"not": "a tokenizer"')
    for read in (inspect_checkpoint, load_checkpoint):
        with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a tokenizer the tokenizers library can read"):
            read(tiny_dir)
