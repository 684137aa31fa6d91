"""EAGLE-3's head in plain PyTorch: a one-layer decoder over the target's tapped hidden states.

The target's outputs at three layers (low, middle, high) are concatenated and projected to the
hidden size by `fc`: the feature of a position. The head's one decoder layer reads, at position
p, the normed embedding of token p + 1 beside the normed feature of position p (its q, k and v
map that width 2H), keeps the feature as its residual stream, and predicts token p + 2 through
its own LM head (over a reduced draft vocabulary, mapped back by `d2t`, where the checkpoint has
one). How it drafts, keeps its cache and runs on the kernels: engine/drafters/eagle3.py.

The checkpoint is a directory in the layout SpecForge and the EAGLE-3 reference write (see
`Eagle3Config`): config.json and model.safetensors with fc, midlayer.*, norm, lm_head, and d2t
and t2d when the draft vocabulary is reduced; or in vLLM's speculators layout, whose layer is
layers.0.*. The embedding is the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from engine.model.config import Eagle3Config, ModelConfig, check_weights, eagle3_taps, inspect_eagle3, stored_weights
from engine.model.transformer import RMSNorm, Rotary, Transformer, apply_rope
from engine.model.vocabulary import DraftVocabulary


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        width = 2 * config.hidden_size  # the embedding and the feature side by side
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(width, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(width, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(width, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)


class Eagle3Model(DraftVocabulary, nn.Module):
    """The head's weights, named as the published checkpoints name them, and its phases: `qkv`
    of a position's embedding and feature, then `finish` once the attention ran, then `logits`."""

    def __init__(self, config: Eagle3Config, taps: tuple[int, ...]) -> None:
        super().__init__()
        self.config = config
        self.taps = taps  # the target layers it reads, resolved against the target
        self.fc = nn.Linear(len(taps) * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        if config.draft_vocab_size < config.vocab_size:
            # Draft id d is target id d + d2t[d]; t2d marks the target ids the head can draft.
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = Rotary(config.rope, config.head_dim)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin for `positions` (any shape), with a heads axis before the last."""
        return self.rotary(positions, self.fc.weight.dtype)

    def features(self, taps: Tensor) -> Tensor:
        """The feature of the target's tapped hidden states side by side ([..., taps * H])."""
        return self.fc(taps)

    def qkv(self, embeds: Tensor, features: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values ([..., heads, D]) of positions whose next token's embedding is
        `embeds` and whose feature is `features` ([..., H] each)."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(features)), dim=-1)
        cos, sin = self.rope(positions)
        q = apply_rope(attn.q_proj(x).unflatten(-1, (attn.heads, attn.head_dim)), cos, sin)
        k = apply_rope(attn.k_proj(x).unflatten(-1, (attn.kv_heads, attn.head_dim)), cos, sin)
        return q, k, attn.v_proj(x).unflatten(-1, (attn.kv_heads, attn.head_dim))

    def finish(self, attended: Tensor, features: Tensor) -> Tensor:
        """The layer's output feature from the attention's output ([..., heads, D]); the residual
        stream is the input feature, or its norm where the head was trained so (speculators')."""
        layer = self.midlayer
        residual = layer.hidden_norm(features) if self.config.norm_before_residual else features
        x = residual + layer.self_attn.o_proj(attended.flatten(-2))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, out: Tensor) -> Tensor:
        """Logits over the target's vocabulary of an output feature."""
        return self.full_vocabulary(self.draft_logits(out))

    def draft_logits(self, out: Tensor) -> Tensor:
        """Logits over the draft vocabulary (draft id d is target id `draft_to_target()[d]`)."""
        return self.lm_head(self.norm(out))


def save_eagle3(model: Eagle3Model, path: Path, dtype: torch.dtype | None = None) -> None:
    """The head's directory; its float weights in `dtype` if given (the maps stay integers)."""
    path.mkdir(parents=True, exist_ok=True)
    raw = model.config.to_json()
    if dtype is not None:
        raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = {
        k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in model.state_dict().items()
    }
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def head_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A checkpoint's tensors by the names Eagle3Model gives them: the speculators layout names the
    one decoder layer layers.0, SpecForge midlayer; a head carrying the target's embedding drops it
    (the target's is used)."""
    return {
        (f"midlayer.{k[len('layers.0.') :]}" if k.startswith("layers.0.") else k): v
        for k, v in state.items()
        if k != "embed_tokens.weight"
    }


def inspect_eagle3_weights(path: Path, target: ModelConfig) -> Eagle3Config:
    """`inspect_eagle3`, and the names and shapes of the weights, read from their file's header,
    against the head its config describes: what loading would find wrong, without loading."""
    config = inspect_eagle3(path, target)
    with torch.device("meta"):
        expected = Eagle3Model(config, eagle3_taps(config, target)).state_dict()
    weights = path / "model.safetensors"
    check_weights(weights, head_state(stored_weights(weights)), expected)
    return config


def load_eagle3(path: str | Path, target: Transformer) -> Eagle3Model:
    path = Path(path)
    config = inspect_eagle3(path, target.config)  # the config, checked against the target
    model = Eagle3Model(config, eagle3_taps(config, target.config))
    weights = path / "model.safetensors"
    state = head_state(load_file(str(weights)))
    check_weights(weights, state, model.state_dict())
    DraftVocabulary.check_map(weights, state, config.draft_vocab_size, config.vocab_size)
    model.load_state_dict(state)  # copied into the model's own buffers: the maps stay long and bool
    # On a CPU the head runs in float32; elsewhere in the target's dtype (`to` casts floats only).
    device = target.device
    dtype = torch.float32 if device.type == "cpu" else target.embed_tokens.weight.dtype
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
