"""GGUF files (llama.cpp's single-file checkpoints) read as checkpoints: the model's shape from
the file's metadata, its weights, and its tokenizer, EOS ids and chat template.

The file is memory-mapped (`gguf.GGUFReader`). Reading a tensor is two steps, so that kernels
that compute on quantized blocks can take the first step's output as it is: `raw_tensors` gives
each weight as the file stores it (its GGML type and raw blocks, rows in the model's order) under
its Hugging Face name, and `dequantize` turns one into float32.

Supported: the llama (Mistral files say llama), qwen2 and qwen3 architectures, every tensor type
the gguf package can dequantize, and byte-level BPE tokenizers ("gpt2") with the pre-tokenizers
below. Imports no torch: a configuration check reads files through here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as _dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.model.config import CheckpointError, ModelConfig, RopeConfig

MAGIC = b"GGUF"
# GGUF's architecture -> the family ModelConfig knows. Mistral files say llama.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# The file's tensor names -> Hugging Face's, per layer and for the rest.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# llama.cpp's pre-tokenizers (tokenizer.ggml.pre) as the `tokenizers` library's: the text is split
# by each regex in turn (its matches and the text between them all kept), then mapped to bytes.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_SPLITS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT,
    **dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "jais"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), (r"\p{N}", _GPT2)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), (_QWEN2,)),
}
# The pre-tokenizers for which llama.cpp takes a word found whole in the vocabulary as one token
# (tokenizer.json's "ignore_merges"), and adds BOS unless the file says otherwise.
_LLAMA3_LIKE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts as a GGUF does (or is named like one)."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as handle:
            return handle.read(4) == MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class RawTensor:
    """One weight as the file stores it."""

    name: str  # the file's name for it ("blk.0.attn_q.weight")
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch's order, rows first (GGML lists dimensions the other way round)
    data: np.ndarray  # the stored values or blocks, one row of the weight per row


@cache
def supported_type(kind: GGMLQuantizationType) -> bool:
    """Whether the gguf package dequantizes tensors of type `kind` (tried on one zero block)."""
    block, size = GGML_QUANT_SIZES[kind]
    try:
        _dequantize(np.zeros((1, size), np.uint8), kind)
    except (NotImplementedError, ValueError):
        return False
    return True


def dequantize(tensor: RawTensor) -> np.ndarray:
    """The weight as a float32 array of its shape (a copy: the mapped file is read-only)."""
    values = _dequantize(tensor.data, tensor.type).reshape(tensor.shape)
    return values.astype(np.float32, copy=not values.flags.writeable or values.dtype != np.float32)


@dataclass(frozen=True)
class Groups:
    """A weight [n, k] unpacked from its blocks into groups (engine/model/quantize.py's layout):
    `values` int8, or uint8 holding 0..15 (uint4); float32 `scales` and `mins` (None: 0) per
    `group` inputs of a row."""

    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    group: int

    @property
    def uint4(self) -> bool:
        return self.values.dtype == np.uint8


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, widened to float32 (exactly)."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., m] as 2m 4-bit values: every byte's low nibble, then every byte's high one."""
    return np.concatenate((qs & 15, qs >> 4), axis=-1)


def _q8_0(b: np.ndarray) -> Groups:
    return Groups(b[..., 2:].copy().view(np.int8), _half(b, 0), None, 32)


def _q4_0(b: np.ndarray) -> Groups:
    d = _half(b, 0)
    return Groups(_nibbles(b[..., 2:]), d, -8 * d, 32)


def _q4_1(b: np.ndarray) -> Groups:
    return Groups(_nibbles(b[..., 4:]), _half(b, 0), _half(b, 2), 32)


def _q4_k(b: np.ndarray) -> Groups:
    """256 values: 8 sub-blocks of 32, each with a 6-bit scale and min (packed in 12 bytes) times
    the super-block's d and dmin; each 32 bytes of values hold two sub-blocks, low nibbles first."""
    d, dmin, packed = _half(b, 0)[..., None], _half(b, 2)[..., None], b[..., 4:16]
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = np.concatenate((low & 63, (high & 15) | ((low >> 6) << 4)), axis=-1)
    least = np.concatenate((mid & 63, (high >> 4) | ((mid >> 6) << 4)), axis=-1)
    chunks = b[..., 16:].reshape(*b.shape[:-1], 4, 32)
    values = _nibbles(chunks).reshape(*b.shape[:-1], 256)
    return Groups(values, d * scale, -(dmin * least), 32)


def _q6_k(b: np.ndarray) -> Groups:
    """256 values: 16 sub-blocks of 16 with int8 scales times d; each half of 128 values holds its
    low 4 bits in 64 bytes (nibbles) and its high 2 bits in 32 (four to a byte)."""
    ql = b[..., :128].reshape(*b.shape[:-1], 2, 64)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 32)
    high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    values = (_nibbles(ql) | (high << 4)).astype(np.int8) - np.int8(32)
    scales = b[..., 192:208].copy().view(np.int8).astype(np.float32)
    return Groups(values.reshape(*b.shape[:-1], 256), _half(b, 208)[..., None] * scales, None, 16)


_UNPACK = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
GROUPED = frozenset(_UNPACK)  # the types whose blocks are groups once unpacked


def unpack_groups(tensor: RawTensor) -> Groups:
    """A weight of a type in GROUPED as groups, exactly the values `dequantize` gives once
    widened (each product exact in float32, see engine/model/quantize.py)."""
    n, k = tensor.shape
    block, size = GGML_QUANT_SIZES[tensor.type]
    blocks = np.asarray(tensor.data).reshape(n, k // block, size)
    unpacked = _UNPACK[tensor.type](blocks)
    return Groups(
        unpacked.values.reshape(n, k),
        unpacked.scales.reshape(n, -1),
        unpacked.mins.reshape(n, -1) if unpacked.mins is not None else None,
        unpacked.group,
    )


class GGUFCheckpoint:
    """A GGUF file, read lazily: opening it parses only its header (CheckpointError where it is
    not a GGUF, is cut short, or is of an architecture or tensor type not supported)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as handle:
                magic = handle.read(4)
        except OSError as err:
            raise CheckpointError(f"{self.path}: cannot be read ({err.strerror})") from None
        if magic != MAGIC:
            found = "it is empty" if not magic else f"it starts with {magic!r}, not {MAGIC!r}"
            raise CheckpointError(f"{self.path}: not a GGUF file ({found})")
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, KeyError, IndexError, OSError, UnicodeDecodeError) as err:
            # The reader fails on a short read with an error about array shapes.
            raise CheckpointError(f"{self.path}: a GGUF file cut short or corrupt ({err})") from None
        self.architecture = str(self._field("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: unsupported architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        self._tensors = {t.name: t for t in self.reader.tensors}
        unsupported = sorted({t.tensor_type.name for t in self.reader.tensors if not supported_type(t.tensor_type)})
        if unsupported:
            raise CheckpointError(
                f"{self.path}: unsupported tensor type {', '.join(unsupported)} in a {self.architecture} model"
            )

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.architecture}.{key}", default)

    @cached_property
    def config(self) -> ModelConfig:
        """The model's shape from the file's metadata; which optional parts it has (biases, q/k
        norms, a separate output head) from which tensors it holds."""
        source = str(self.path)
        if "rope_freqs.weight" in self._tensors or self._arch("rope.scaling.type", "none") not in ("none", None):
            raise CheckpointError(f"{source}: rope scaling is not supported (a {self.architecture} model)")
        try:
            hidden = int(self._arch("embedding_length"))
            heads = int(self._arch("attention.head_count"))
            kv_heads = int(self._arch("attention.head_count_kv", heads))
            head_dim = int(self._arch("attention.key_length", hidden // heads))
            config = ModelConfig(
                family=ARCHITECTURES[self.architecture],
                vocab_size=int(self._tensors["token_embd.weight"].shape[-1]),
                hidden_size=hidden,
                intermediate_size=int(self._arch("feed_forward_length")),
                num_layers=int(self._arch("block_count")),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=_decimal(self._arch("attention.layer_norm_rms_epsilon", 1e-6)),
                rope=RopeConfig(theta=_decimal(self._arch("rope.freq_base", 10000.0))),
                max_position_embeddings=int(self._arch("context_length", 2048)),
                tie_word_embeddings="output.weight" not in self._tensors,
                attention_bias="blk.0.attn_q.bias" in self._tensors,
                output_bias="blk.0.attn_output.bias" in self._tensors,
                mlp_bias="blk.0.ffn_up.bias" in self._tensors,
                qk_norm="blk.0.attn_q_norm.weight" in self._tensors,
            )
        except KeyError as missing:
            raise CheckpointError(f"{source}: no tensor {missing.args[0]!r}") from None
        except TypeError as err:  # a key missing (None), or an array where a number belongs
            raise CheckpointError(f"{source}: incomplete {self.architecture} metadata ({err})") from None
        if self._arch("attention.value_length", head_dim) != head_dim:
            raise CheckpointError(f"{source}: value heads narrower or wider than key heads are not supported")
        if self._arch("rope.dimension_count", head_dim) != head_dim:
            raise CheckpointError(f"{source}: rotary embedding over part of each head is not supported")
        if heads % kv_heads:
            raise CheckpointError(f"{source}: {heads} attention heads is not a multiple of {kv_heads} KV heads")
        return config

    def hf_name(self, name: str) -> str:
        """The Hugging Face name of the file's tensor `name` (itself where there is none)."""
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        block, _, rest = name.partition(".")
        layer, _, part = rest.partition(".")
        if block == "blk" and layer.isdigit() and part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}"
        return name

    def raw_tensors(self) -> Iterator[tuple[str, RawTensor]]:
        """Each weight under its Hugging Face name, as stored. llama.cpp's converter reorders the
        rows of a llama-architecture file's q and k projections within each head (its rotary
        embedding pairs adjacent dimensions, Hugging Face's the two halves); the rows are put back
        here. Rows are whole quantization blocks, so this holds for every type."""
        for tensor in self.reader.tensors:
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            data = tensor.data
            if self.architecture == "llama" and tensor.name.split(".")[-2] in ("attn_q", "attn_k"):
                config = self.config
                heads = config.num_heads if ".attn_q." in tensor.name else config.num_kv_heads
                data = _unpermute(data, heads)
            yield self.hf_name(tensor.name), RawTensor(tensor.name, tensor.tensor_type, shape, data)

    def stored_types(self) -> set[str]:
        """The GGML types the file's tensors are stored in ("F32", "Q4_1")."""
        return {t.tensor_type.name for t in self.reader.tensors}

    @cached_property
    def tokens(self) -> list[str]:
        tokens = self._field("tokenizer.ggml.tokens")
        if not tokens:
            raise CheckpointError(f"{self.path}: no tokenizer (tokenizer.ggml.tokens)")
        return tokens

    def vocabulary(self) -> dict[str, int]:
        return {token: index for index, token in enumerate(self.tokens)}

    def _token(self, key: str) -> str:
        index = self._field(f"tokenizer.ggml.{key}")
        return self.tokens[index] if isinstance(index, int) and 0 <= index < len(self.tokens) else ""

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the file's `tokenizer.ggml.*` metadata describes, as llama.cpp runs it."""
        kind = self._field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(
                f"{self.path}: tokenizer model {kind!r} is not supported (only 'gpt2', byte-level BPE)"
            )
        pre = self._field("tokenizer.ggml.pre", "default")
        if pre not in _SPLITS:
            raise CheckpointError(
                f"{self.path}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_SPLITS))}"
            )
        merges = [tuple(merge.split(" ", 1)) for merge in self._field("tokenizer.ggml.merges", [])]
        tokenizer = Tokenizer(models.BPE(self.vocabulary(), merges, ignore_merges=pre in _LLAMA3_LIKE))
        splits: list[Any] = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in _SPLITS[pre]]
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tokenizer.decoder = decoders.ByteLevel()
        types = self._field("tokenizer.ggml.token_type") or []
        special = [i for i, kind in enumerate(types) if kind == _CONTROL]
        added = [i for i, kind in enumerate(types) if kind == _USER_DEFINED]
        # Control and user-defined tokens are matched whole in the text, as llama.cpp does.
        tokenizer.add_special_tokens([AddedToken(self.tokens[i], special=True, normalized=False) for i in special])
        tokenizer.add_tokens([AddedToken(self.tokens[i], special=False, normalized=False) for i in added])
        self._add_bos_eos(tokenizer, pre)
        return tokenizer

    def _add_bos_eos(self, tokenizer: Tokenizer, pre: str) -> None:
        """BOS (and EOS) around an encoded text where the file asks for them, as tokenizer.json's
        post-processor adds them."""
        before, after = [], []
        if self._field("tokenizer.ggml.add_bos_token", pre in _LLAMA3_LIKE) and self._token("bos_token_id"):
            before = [self._token("bos_token_id")]
        if self._field("tokenizer.ggml.add_eos_token", False) and self._token("eos_token_id"):
            after = [self._token("eos_token_id")]
        if not before and not after:
            return
        single = [*before, "$A", *after]
        pair = [*single, *(f"{t}:1" for t in before), "$B:1", *(f"{t}:1" for t in after)]
        ids = {t: tokenizer.token_to_id(t) for t in (*before, *after)}
        tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=list(ids.items())
        )

    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end a generation: EOS, and end-of-turn and end-of-message where the file
        names them (llama.cpp stops at each)."""
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        return frozenset(v for k in keys if isinstance(v := self._field(f"tokenizer.ggml.{k}"), int))

    def chat_template(self) -> tuple[str | None, dict[str, str]]:
        """The file's chat template (None where it has none), and the text of each special token
        a template may name."""
        names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
        specials = {name: self._token(f"{key}_token_id") for name, key in names.items()}
        return self._field("tokenizer.chat_template") or None, specials

    def check(self) -> ModelConfig:
        """What a configuration check reads: the shape, every tensor named as a supported model's
        and of the shape the metadata implies, none missing, and the tokenizer; CheckpointError
        naming what is wrong."""
        config = self.config
        expected = expected_shapes(config)
        for tensor in self.reader.tensors:
            name = self.hf_name(tensor.name)
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            if name not in expected:
                raise CheckpointError(f"{self.path}: unexpected tensor {tensor.name!r} in a {self.architecture} model")
            if shape != expected.pop(name):
                raise CheckpointError(f"{self.path}: tensor {tensor.name!r} has shape {shape}, not its model's")
        missing = [name for name in expected if name != "lm_head.weight" or not config.tie_word_embeddings]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{self.path}: missing tensor {missing[0]!r}{more}")
        if len(self.tokens) > config.vocab_size:
            raise CheckpointError(f"{self.path}: {len(self.tokens)} tokens, more than the model's {config.vocab_size}")
        self.tokenizer()
        return config


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of `config` has, by its Hugging Face name, in torch's order."""
    d, f, hd, v = config.hidden_size, config.intermediate_size, config.head_dim, config.vocab_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    layer |= {"self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d), "self_attn.v_proj.weight": (kv, d)}
    layer |= {"self_attn.o_proj.weight": (d, q), "mlp.down_proj.weight": (d, f)}
    layer |= {"mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d)}
    if config.attention_bias:
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if config.output_bias:
        layer["self_attn.o_proj.bias"] = (d,)
    if config.mlp_bias:
        layer |= {"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (d,)}
    if config.qk_norm:
        layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(config.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _decimal(value: float) -> float:
    """A float32 from the file as the decimal it was written from (1e-05, not 9.9999997e-06): the
    value config.json would give, so that a model runs the same from either."""
    return float(str(np.float32(value)))


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of a q or k projection's rows: within each head, its rows
    (2, half) were laid out as (half, 2)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def inspect_gguf(path: Path) -> ModelConfig:
    """A GGUF checkpoint's config, read and checked without dequantizing any weight."""
    return GGUFCheckpoint(path).check()
