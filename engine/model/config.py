"""The model's shape, read from a Hugging Face `config.json`.

One decoder covers the Llama, Mistral, Qwen2 and Qwen3 families; the family only decides which
optional parts are switched on (biases, q/k norms, sliding window).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v (Qwen2; Llama with attention_bias)
    output_bias: bool = False  # bias on o_proj (Llama with attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        family = None
        for name in architectures:
            family = SUPPORTED_ARCHITECTURES.get(name)
            if family:
                break
        if family is None:
            family = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}.get(
                raw.get("model_type", "")
            )
        if family is None:
            found = architectures or raw.get("model_type")
            raise CheckpointError(
                f"{source}: unsupported architecture {found!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            config = cls(
                family=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_rope_from_hf(raw, source),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
                output_bias=family in ("llama", "qwen3") and bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=family == "qwen3",
                sliding_window=_sliding_window(family, raw, source),
            )
        except KeyError as missing:
            raise CheckpointError(f"{source}: missing key {missing.args[0]!r}") from None
        if config.num_heads % config.num_kv_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads {config.num_heads} is not a multiple of "
                f"num_key_value_heads {config.num_kv_heads}"
            )
        return config

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: not found") from None
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{path}: invalid JSON ({err})") from None
        return cls.from_hf(raw, str(path))

    def num_parameters(self) -> int:
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * d * f + 2 * d
        embeddings = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + d


def _rope_from_hf(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise CheckpointError(f"{source}: rope type {kind!r} is not supported ('default', 'llama3')")


def _sliding_window(family: str, raw: dict[str, Any], source: str) -> int | None:
    window = raw.get("sliding_window")
    if family == "mistral":
        return int(window) if window else None
    if family in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
        raise CheckpointError(f"{source}: use_sliding_window=true is not supported for {family}")
    return None


# The drafters that run a draft model, which [engine] draft names.
DRAFT_MODEL_KINDS = ("draft_model", "hybrid")
# The drafters that run a DFlash block drafter, which [engine] dflash names.
DFLASH_KINDS = ("dflash", "hybrid_dflash")
# The drafters that run an EAGLE-3 head, which [engine] eagle3 names.
EAGLE3_KINDS = ("eagle3", "hybrid_eagle3")
# Every drafter [engine] drafter may name.
DRAFTERS = (*DRAFT_MODEL_KINDS, "ngram", *DFLASH_KINDS, *EAGLE3_KINDS, "none")
# How [engine] draft_quantization may store drafters' linear weights on a CPU.
DRAFT_QUANTIZATIONS = ("int8", "none")
# How [engine] weights may store the target's linear weights (engine/model/quantize.py).
TARGET_WEIGHTS = ("as_loaded", "int8", "int4")

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def weight_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """The tensors a safetensors file holds and their shapes, read from its header alone;
    CheckpointError naming the file where it cannot be read (cut short, empty, not safetensors)."""
    try:
        # numpy's view: a header read through torch's would import torch into a config check.
        with safe_open(file, framework="numpy") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from None


def stored_weights(file: Path) -> dict[str, Any]:
    """A drafter's weights file as meta tensors of the stored shapes, read from its header alone:
    what `check_weights` compares against a model without loading anything."""
    import torch  # only here: reading a config must not import torch

    return {name: torch.empty(shape, device="meta") for name, shape in weight_shapes(file).items()}


def inspect_checkpoint(path: Path) -> ModelConfig:
    """What a checkpoint directory holds, read without loading its weights: its config, once
    `config.json`, weights and `tokenizer.json` are found (CheckpointError naming what is not)."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such {'file' if path.suffix.lower() == '.gguf' else 'directory'}")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (a checkpoint is a directory or a GGUF file)")
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    if missing:
        raise CheckpointError(f"{path}: not a checkpoint directory, missing {', '.join(missing)}")
    if (path / "model.safetensors").is_file():
        weight_shapes(path / "model.safetensors")
    read_tokenizer(path / "tokenizer.json")
    return ModelConfig.from_file(path / "config.json")


def read_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer in `path` (a tokenizer.json); CheckpointError naming the file where it is not
    one (the tokenizers library's own errors name no file)."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the library raises plain Exception for a file it cannot read
        raise CheckpointError(f"{path}: not a tokenizer the tokenizers library can read ({err})") from None


def tokenizer_vocabulary(path: Path) -> dict[str, int] | None:
    """The token-to-id map of a checkpoint's tokenizer.json, where it has one."""
    try:
        model = json.loads((path / "tokenizer.json").read_text()).get("model") or {}
    except (OSError, ValueError):
        return None
    vocab = model.get("vocab")
    return vocab if isinstance(vocab, dict) else None


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target: str = ""  # the name of the target it was trained for
    # Ids its drafts are chosen from: the target's most frequent (the model's d2t maps them), or
    # 0 for the whole vocabulary. The LM head over a block's drafts is the larger part of its cost.
    draft_vocab_size: int = 0
    # Trained on blocks of every length from 2 to block_size too: a draft of k runs a block of
    # k + 1 (the block's forward is most of a round's drafting, and a shorter one costs less).
    # One trained on whole blocks only drafts worse from a shorter one.
    short_blocks: bool = False
    # A block's last position attends to at most this many (itself included): the context it was
    # trained on, past which its attention has never been fitted. None: the whole context.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not self.draft_vocab_size:
            object.__setattr__(self, "draft_vocab_size", self.vocab_size)

    def to_json(self) -> dict:
        dflash_keys = ("target_layer_ids", "mask_token_id", "short_blocks")
        shape = {k: v for k, v in asdict(self).items() if k not in (*dflash_keys, "num_layers")}
        if self.sliding_window is None:
            del shape["sliding_window"]
        return {
            "architectures": ["DFlashDraftModel"],
            **shape,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                **({"short_blocks": True} if self.short_blocks else {}),
            },
        }

    @classmethod
    def from_json(cls, raw: dict, source: str = "config.json") -> DFlashConfig:
        window = _drafter_window(raw, source)
        try:
            dflash = raw["dflash_config"]
            return cls(
                hidden_size=int(raw["hidden_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=int(raw["num_attention_heads"]),
                num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
                head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"])),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                block_size=int(raw["block_size"]),
                target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
                mask_token_id=int(dflash["mask_token_id"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                target=str(raw.get("target", "")),
                draft_vocab_size=int(raw.get("draft_vocab_size") or 0),
                short_blocks=dflash.get("short_blocks") is True,
                sliding_window=window,
            )
        except KeyError as err:
            if "eagle_config" in raw:
                raise CheckpointError(f"{source}: an EAGLE-3 head's config, not a DFlash drafter's") from None
            raise CheckpointError(f"{source}: not a DFlash config (no {err})") from None
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"{source}: not a DFlash config ({type(err).__name__}: {err})") from None


def split_problem(config: ModelConfig, ranks: int) -> str | None:
    """Why `ranks` ranks cannot share a target of this shape (each takes an equal share of its
    heads, KV heads and MLP units: engine/parallel.py), or None."""
    heads, kv_heads, units = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % ranks or kv_heads % ranks or units % ranks:
        return f"{ranks} ranks cannot share {heads} heads, {kv_heads} KV heads and {units} MLP units evenly"
    return None


def dflash_problems(config: DFlashConfig, target: ModelConfig) -> list[str]:
    """Each way a DFlash drafter does not fit a target, in words."""
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden size {config.hidden_size}, the target's {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocabulary of {config.vocab_size}, the target's {target.vocab_size}")
    outside = [i for i in config.target_layer_ids if not 0 <= i < target.num_layers]
    if outside:
        problems.append(f"taps {outside} outside the target's layers 0..{target.num_layers - 1}")
    if not 0 <= config.mask_token_id < target.vocab_size:
        problems.append(f"mask token id {config.mask_token_id} outside the vocabulary (0..{target.vocab_size - 1})")
    if not 0 < config.draft_vocab_size <= config.vocab_size:
        problems.append(f"draft vocabulary of {config.draft_vocab_size} (needs 1..{config.vocab_size})")
    if config.block_size < 2:
        problems.append(f"block size {config.block_size} (needs at least 2)")
    if config.sliding_window is not None and config.sliding_window < config.block_size:
        problems.append(f"sliding window {config.sliding_window}, shorter than its block of {config.block_size}")
    return problems


def read_drafter_config(path: Path, kind: str) -> dict[str, Any]:
    """The raw config.json of a drafter directory that also holds model.safetensors."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    if not (path / "model.safetensors").is_file():
        raise CheckpointError(f"{path}: not {kind} checkpoint, missing model.safetensors")
    weight_shapes(path / "model.safetensors")
    try:
        raw = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not {kind} checkpoint, missing config.json") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path / 'config.json'}: invalid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path / 'config.json'}: not a JSON object")
    return raw


def check_weights(source: Path, state: dict[str, Any], expected: dict[str, Any]) -> None:
    """A drafter's weights (`state`, from `source`) against its model's (`expected`): the same
    names and shapes, or CheckpointError naming the first that differ."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(f"{source}: {what}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )


def inspect_dflash(path: Path, target: ModelConfig) -> DFlashConfig:
    """A DFlash checkpoint directory's config, checked against the target, without its weights."""
    raw = read_drafter_config(path, "a DFlash")
    config = DFlashConfig.from_json(raw, str(path / "config.json"))
    problems = dflash_problems(config, target)
    if problems:
        raise CheckpointError(f"{path}: does not fit the target: " + "; ".join(problems))
    return config


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head, in the layout SpecForge and the EAGLE-3 reference write: `config.json` as
    a one-layer Llama (architectures LlamaForCausalLMEagle3) with `draft_vocab_size`, the tapped
    layers under `eagle_config.eagle_aux_hidden_state_layer_ids` (the output of each layer, as
    SGLang reads them) and, where it differs from hidden_size, `target_hidden_size`.

    Heads in vLLM's speculators layout (`Eagle3Speculator`, see `from_speculators`) load too."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...] | None  # None: SGLang's default for the target (eagle3_taps)
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    target: str = ""  # the name of the target it was trained for
    # The layer's residual stream starts from the normed feature rather than the feature itself.
    norm_before_residual: bool = False
    # A position attends to at most this many (itself included): the context a head was trained
    # on, past which its attention has never been fitted. None: every position before it.
    sliding_window: int | None = None

    def to_json(self) -> dict:
        raw: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "tie_word_embeddings": False,
            "target": self.target,
        }
        if self.rope.kind != "default":
            rope = asdict(self.rope)
            rope["rope_type"] = rope.pop("kind")
            raw["rope_scaling"] = {k: v for k, v in rope.items() if k != "theta"}
        if self.target_layer_ids is not None:
            raw["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": list(self.target_layer_ids),
                "use_aux_hidden_state": True,
            }
        if self.norm_before_residual:
            raw["norm_before_residual"] = True
        if self.sliding_window is not None:
            raw["sliding_window"] = self.sliding_window
        return raw

    @classmethod
    def from_json(cls, raw: dict, source: str = "config.json") -> Eagle3Config:
        if "speculators_model_type" in raw:
            return cls.from_speculators(raw, source)
        architectures = raw.get("architectures") or []
        if architectures and not set(architectures) & {"LlamaForCausalLMEagle3", "LlamaForCausalLM"}:
            # The EAGLE-3 reference writes LlamaForCausalLM, SpecForge LlamaForCausalLMEagle3.
            raise CheckpointError(f"{source}: not an EAGLE-3 head (architectures {architectures})")
        layers = raw.get("num_hidden_layers", 1)
        if layers != 1:
            raise CheckpointError(f"{source}: an EAGLE-3 head has one decoder layer, this config has {layers}")
        window = _drafter_window(raw, source)
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            eagle = raw.get("eagle_config") or {}
            taps = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
            vocab = int(raw["vocab_size"])
            return cls(
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=vocab,
                draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
                target_hidden_size=int(raw.get("target_hidden_size") or hidden),
                target_layer_ids=tuple(int(i) for i in taps) if taps else None,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_rope_from_hf(raw, source),
                target=str(raw.get("target", "")),
                norm_before_residual=bool(raw.get("norm_before_residual", False)),
                sliding_window=window,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{source}: not an EAGLE-3 config ({type(err).__name__}: {err})") from None

    @classmethod
    def from_speculators(cls, raw: dict, source: str = "config.json") -> Eagle3Config:
        """A head in vLLM's speculators layout: the decoder layer's Llama config under
        `transformer_layer_config`, the EAGLE-3 fields at the top. Its tap ids count as vLLM
        counts them (id j is the input of layer j, the output of layer j - 1), and its residual
        starts from the normed feature unless `norm_before_residual` is false."""
        kind = raw.get("speculators_model_type")
        if kind != "eagle3":
            raise CheckpointError(f"{source}: a speculators head of type {kind!r}; only eagle3 heads load")
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise CheckpointError(f"{source}: a speculators head needs a transformer_layer_config object")
        for unsupported in ("norm_before_fc", "fc_norm"):
            if raw.get(unsupported):
                raise CheckpointError(f"{source}: {unsupported} (a norm of the taps before fc) is not supported")
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and not all(isinstance(i, int) and i >= 1 for i in ids):
            raise CheckpointError(
                f"{source}: eagle_aux_hidden_state_layer_ids {ids}: ids count layer inputs from 1 "
                "(0 is the embedding, which EAGLE-3 does not read)"
            )
        verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
        merged = {
            **{k: v for k, v in layer.items() if k != "architectures"},
            "draft_vocab_size": raw.get("draft_vocab_size"),
            "target_hidden_size": raw.get("target_hidden_size"),
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids] if ids else None,
            "norm_before_residual": raw.get("norm_before_residual", True),
            "target": verifier.get("name_or_path", "") if isinstance(verifier, dict) else "",
        }
        return cls.from_json(merged, source)


def _drafter_window(raw: dict[str, Any], source: str) -> int | None:
    """A drafter's sliding_window: a whole number of positions >= 1, or null (0 reads as null, as
    transformers' configs write it, and so does any window beside use_sliding_window false, as
    Qwen configs carry one they do not use)."""
    window = raw.get("sliding_window")
    if window is None or window == 0 or raw.get("use_sliding_window") is False:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointError(
            f"{source}: sliding_window must be a whole number of positions >= 1 or null, got {window!r}"
        )
    return window


def eagle3_taps(config: Eagle3Config, target: ModelConfig) -> tuple[int, ...]:
    """The target layers whose outputs the head reads: the checkpoint's, or SGLang's default (the
    inputs of layers 2, L/2 and L-3, that is the outputs of layers 1, L/2 - 1 and L-4)."""
    if config.target_layer_ids is not None:
        return config.target_layer_ids
    layers = target.num_layers
    return tuple(max(0, i) for i in (1, layers // 2 - 1, layers - 4))


def eagle3_problems(config: Eagle3Config, target: ModelConfig) -> list[str]:
    """Each way an EAGLE-3 head does not fit a target, in words."""
    problems = []
    if config.target_hidden_size != target.hidden_size:
        problems.append(f"target hidden size {config.target_hidden_size}, the target's {target.hidden_size}")
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden size {config.hidden_size}, the target's embedding width {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocabulary of {config.vocab_size}, the target's {target.vocab_size}")
    if not 0 < config.draft_vocab_size <= config.vocab_size:
        problems.append(f"draft vocabulary of {config.draft_vocab_size} (needs 1..{config.vocab_size})")
    taps = eagle3_taps(config, target)
    if len(taps) != 3:
        problems.append(f"{len(taps)} tapped layers {list(taps)} (EAGLE-3 reads three)")
    outside = [i for i in taps if not 0 <= i < target.num_layers]
    if outside:
        problems.append(f"taps {outside} outside the target's layers 0..{target.num_layers - 1}")
    return problems


def inspect_eagle3(path: Path, target: ModelConfig) -> Eagle3Config:
    """An EAGLE-3 head directory's config, checked against the target, without its weights."""
    raw = read_drafter_config(path, "an EAGLE-3")
    config = Eagle3Config.from_json(raw, str(path / "config.json"))
    problems = eagle3_problems(config, target)
    if problems:
        raise CheckpointError(f"{path}: does not fit the target: " + "; ".join(problems))
    return config
