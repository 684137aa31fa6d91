"""GGUF files written from Hugging Face checkpoint directories, laid out as llama.cpp's converter
lays them out (its names, its q/k row order for llama files, norms kept in F32), for tests."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

# Hugging Face's per-layer names -> llama.cpp's.
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GLOBAL["lm_head.weight"] = "output.weight"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of a llama q or k projection's rows."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def round_trip(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """What a weight becomes once stored as `kind`: the values a loader of the file must see."""
    return gguf.quants.dequantize(quantize(values, kind), kind).reshape(values.shape)


def quantize(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """`values` [n, k] as blocks of `kind`: the gguf package's quantizer where it has one, else
    (Q4_K, Q6_K) simple round-to-nearest blocks built here, laid out as llama.cpp lays them."""
    if kind == gguf.GGMLQuantizationType.Q4_K:
        return _q4_k(values.astype(np.float32))
    if kind == gguf.GGMLQuantizationType.Q6_K:
        return _q6_k(values.astype(np.float32))
    return gguf.quants.quantize(values, kind)


def _safe(t: np.ndarray) -> np.ndarray:
    return np.where(t > 0, t, 1)


def _f16_bytes(t: np.ndarray) -> np.ndarray:
    return t.astype(np.float16)[..., None].view(np.uint8)


def _q4_k(values: np.ndarray) -> np.ndarray:
    """Super-blocks of 256: 8 sub-blocks of 32 from their min (at most 0) in 15 steps; 6-bit
    scales and mins times a float16 d and dmin."""
    n, k = values.shape
    x = values.reshape(n, k // 256, 8, 32)
    low, high = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    step = (high - low) / 15
    d, dmin = (step.max(-1) / 63).astype(np.float16), ((-low).max(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(step / _safe(d32)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / _safe(dmin32)), 0, 63).astype(np.uint8)
    scale, offset = (d32 * sc)[..., None], (dmin32 * m)[..., None]
    q = np.clip(np.round((x + offset) / _safe(scale)), 0, 15).astype(np.uint8).reshape(n, -1, 4, 2, 32)
    packed = np.concatenate(
        (
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4),
        ),
        axis=-1,
    )
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, -1, 128)
    return np.concatenate((_f16_bytes(d), _f16_bytes(dmin), packed, qs), axis=-1).reshape(n, -1)


def _q6_k(values: np.ndarray) -> np.ndarray:
    """Super-blocks of 256: 16 sub-blocks of 16 in -32..31 around 0, int8 scales times a float16 d;
    low 4 bits as nibbles, high 2 bits four to a byte."""
    n, k = values.shape
    x = values.reshape(n, k // 256, 16, 16)
    step = np.abs(x).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(step / _safe(d32)), -128, 127).astype(np.int8)
    scale = (d32 * sc)[..., None]
    q = (np.clip(np.round(x / _safe(scale)), -32, 31) + 32).astype(np.uint8).reshape(n, -1, 2, 128)
    ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)
    qh = sum((q[..., 32 * i : 32 * (i + 1)] >> 4) << (2 * i) for i in range(4)).astype(np.uint8)
    parts = (ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8), _f16_bytes(d))
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def write_gguf(
    checkpoint: Path,
    out: Path,
    kind: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    architecture: str | None = None,
    pre: str = "gpt-2",
    chat_template: str | None = CHAT_TEMPLATE,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
    leave_out: str | None = None,
) -> Path:
    """`checkpoint` (a directory with a byte-level BPE tokenizer.json) as a GGUF file at `out`,
    its matrices stored as `kind` (or as `types` names per llama.cpp tensor name), but for the
    tensor `leave_out` names."""
    config = json.loads((checkpoint / "config.json").read_text())
    architecture = architecture or config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(config["vocab_size"])
    _write_tokenizer(writer, checkpoint, pre, chat_template)

    tensors = {k: v.float().numpy() for k, v in load_file(checkpoint / "model.safetensors").items()}
    types = types or {}
    for hf, values in tensors.items():
        name = gguf_name(hf)
        if name == leave_out:
            continue
        if architecture == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            values = _permute(values, heads if ".attn_q." in name else kv_heads)
        stored = types.get(name, kind if values.ndim == 2 else gguf.GGMLQuantizationType.F32)
        if stored == gguf.GGMLQuantizationType.I32:  # a type no model weight is stored in
            writer.add_tensor(name, values.astype(np.int32))
        elif stored in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, gguf.quants.quantize(values, stored))
        else:
            writer.add_tensor(name, quantize(values, stored), raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_tokenizer(writer: gguf.GGUFWriter, checkpoint: Path, pre: str, chat_template: str | None) -> None:
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    eos = json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def dequantized_copy(checkpoint: Path, out: Path, kind: gguf.GGMLQuantizationType) -> Path:
    """`checkpoint` with each matrix replaced by what storing it as `kind` makes of it: the model a
    GGUF of that type holds, as a directory."""
    out.mkdir(parents=True)
    for item in checkpoint.iterdir():
        if item.name != "model.safetensors":
            (out / item.name).write_bytes(item.read_bytes())
    tensors = load_file(checkpoint / "model.safetensors")
    stored = {
        name: torch.from_numpy(round_trip(t.float().numpy(), kind)) if t.ndim == 2 else t.float()
        for name, t in tensors.items()
    }
    save_file(stored, out / "model.safetensors")
    return out
