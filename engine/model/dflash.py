"""DFlash: a block drafter that proposes every token of a block in one forward pass.

The target's hidden states at a few layers (the taps) are concatenated, projected to the hidden
size and normed: the context features. Every draft layer turns them into keys and values (with
its k-norm, and RoPE at their true positions), kept per sequence in the drafter's own cache as
the target accepts tokens (only kept tokens enter it, so nothing rolls back). A draft is one
forward of the block
[last accepted token, mask x (B-1)] whose queries see the whole context and the whole block
(no causal mask inside the block); the outputs at block positions 1..k are the drafts. The
newest token has no target hidden state yet, so the context lags it by one. The embedding and
the LM head are the target's. Beside a target on the compiled CPU kernels, both the context and
the block run on them (engine/native/dflash.py); elsewhere on PyTorch operators.

The checkpoint is a directory: config.json (z-lab's keys: block_size, dflash_config with
target_layer_ids and mask_token_id, and the shape of the draft layers) and model.safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from engine.model.config import DFlashConfig, ModelConfig, RopeConfig, check_weights, inspect_dflash, stored_weights
from engine.model.layers import float_weight
from engine.model.transformer import RMSNorm, Rotary, Transformer, apply_rope, visible_keys
from engine.model.vocabulary import DraftVocabulary


def default_taps(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` taps spread evenly from layer 1 to layer L-3 (a tap is the output of that layer)."""
    if count == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    if last <= first:  # a target too shallow for the rule: spread over all its layers
        first, last = 0, num_target_layers - 1
    return tuple(round(first + (last - first) * i / (count - 1)) for i in range(count))


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of `x` ([..., T, H]) at the positions `cos` and `sin` were made for."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)))
        return apply_rope(k, cos, sin), self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, context_k: Tensor, context_v: Tensor, mask: Tensor
    ) -> Tensor:
        """x: the block [B, S, H]; context_k/v: [B, C, kv_heads, D]; mask: [B, 1, S, C + S]."""
        h = self.input_layernorm(x)
        q = apply_rope(self.q_norm(self.q_proj(h).unflatten(-1, (self.heads, self.head_dim))), cos, sin)
        k, v = self.keys_values(h, cos, sin)
        keys = torch.cat((context_k, k), dim=1).transpose(1, 2)
        values = torch.cat((context_v, v), dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
        x = x + self.o_proj(out.transpose(1, 2).flatten(-2))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DFlashModel(DraftVocabulary, nn.Module):
    """The draft layers; the embedding and the LM head come from the target at each call (the
    head's rows of the draft vocabulary only, where the checkpoint has one)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.draft_vocab_size < config.vocab_size:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.rotary = Rotary(RopeConfig(theta=config.rope_theta), config.head_dim)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin for `positions` (any shape), with a heads axis before the last."""
        return self.rotary(positions, self.fc.weight.dtype)

    def features(self, taps: Seq[Tensor]) -> Tensor:
        """The context features of the target's tapped hidden states ([..., H] each)."""
        return self.fused(torch.cat(list(taps), dim=-1))

    def fused(self, taps: Tensor) -> Tensor:
        """The context features of the tapped hidden states side by side ([..., taps * H])."""
        return self.hidden_norm(self.fc(taps))

    def context(self, features: Tensor, positions: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Each draft layer's keys and values ([..., T, kv_heads, D]) of context features at `positions`."""
        cos, sin = self.rope(positions)
        pairs = [layer.keys_values(features, cos, sin) for layer in self.layers]
        return [k for k, _ in pairs], [v for _, v in pairs]

    def forward(
        self,
        block: Tensor,
        positions: Tensor,
        context_k: Seq[Tensor],
        context_v: Seq[Tensor],
        mask: Tensor,
        target: Transformer,
        drafts: int | None = None,
        head: Tensor | None = None,
    ) -> Tensor:
        """Logits over the draft vocabulary of every block position [B, S, V], or of the first
        `drafts` after the first ([B, drafts, V]: the LM head need not run on the others). block: token ids [B, S];
        positions [B, S]; context_k/v: per layer [B, C, kv_heads, D]; mask: which keys (context,
        then block) each block position sees, [B, 1, S, C + S]; head: `head(target)`, where the
        caller keeps it rather than gathering those rows again each call."""
        x = target.embed_tokens(block).to(self.fc.weight.dtype)
        cos, sin = self.rope(positions)
        for layer, k, v in zip(self.layers, context_k, context_v):
            x = layer(x, cos, sin, k, v, mask)
        if drafts is not None:
            x = x[:, 1 : drafts + 1]
        x = self.norm(x).to(target.lm_head.weight.dtype)
        if self.config.draft_vocab_size < self.config.vocab_size:
            return F.linear(x, head if head is not None else self.head(target))
        if torch.is_grad_enabled():  # training: a CPU target's packed head (Linear.pack) has no backward
            return F.linear(x, target.lm_head.weight)
        return target.lm_head(x)

    def head(self, target: Transformer) -> Tensor:
        """The rows of the target's LM head of the draft vocabulary ([draft vocab, H])."""
        return float_weight(target.lm_head).index_select(0, self.draft_to_target())


def block_mask(context_len: Tensor, width: int, size: int, window: int | None = None) -> Tensor:
    """At inference: each of a block's `size` positions sees its sequence's first context_len[b]
    context keys (of `width`) and the whole block; with a sliding `window`, only the keys within
    it of the block's last position. [B, 1, size, width + size]."""
    batch, device = context_len.shape[0], context_len.device
    visible = torch.arange(width, device=device)[None, :] < context_len[:, None]
    whole = torch.ones(batch, size, dtype=torch.bool, device=device)
    if window is not None:  # every position of the block sees back as far as its last one
        last = context_len[:, None] + size - 1
        visible &= visible_keys(last, torch.arange(width, device=device)[None, :], window)
        whole &= visible_keys(last, context_len[:, None] + torch.arange(size, device=device)[None, :], window)
    return torch.cat((visible, whole), dim=1)[:, None, None, :].expand(batch, 1, size, width + size)


def save_dflash(model: DFlashModel, path: Path, dtype: torch.dtype | None = None) -> None:
    """config.json and model.safetensors in `path`; the weights in `dtype` where given (the loader
    casts them to the dtype the drafter runs in)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    state = {k: v.to(dtype) if dtype and v.is_floating_point() else v for k, v in model.state_dict().items()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def inspect_dflash_weights(path: Path, target: ModelConfig) -> DFlashConfig:
    """`inspect_dflash`, and the names and shapes of the weights, read from their file's header,
    against the drafter its config describes: what loading would find wrong, without loading."""
    config = inspect_dflash(path, target)
    with torch.device("meta"):
        expected = DFlashModel(config).state_dict()
    weights = path / "model.safetensors"
    check_weights(weights, stored_weights(weights), expected)
    return config


def load_dflash(path: str | Path, target: Transformer) -> DFlashModel:
    path = Path(path)
    config = inspect_dflash(path, target.config)  # the config, checked against the target
    model = DFlashModel(config)
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    check_weights(weights, state, model.state_dict())
    DraftVocabulary.check_map(weights, state, config.draft_vocab_size, config.vocab_size)
    model.load_state_dict(state)
    # On a CPU the drafter runs in float32 (PyTorch operators); elsewhere in the target's dtype.
    device = target.device
    return (
        model.to(device=device, dtype=torch.float32 if device.type == "cpu" else target.embed_tokens.weight.dtype)
        .eval()
        .requires_grad_(False)
    )
