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
the block run on them (engine/native.py `NativeDFlash`); elsewhere on PyTorch operators.

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

from engine import native
from engine.backend import Backend
from engine.config import DFlashConfig, ModelConfig, RopeConfig, check_weights, inspect_dflash
from engine.drafters import DraftVocabulary, LookupFirst, Proposal, stored_weights
from engine.graphs import CallGraphs
from engine.kv_cache import KVCache
from engine.model import RMSNorm, Rotary, Transformer, apply_rope, side_by_side, visible_keys
from engine.native import NativeDFlash
from engine.request import Sequence
from engine.sampling import sample, target_probs


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
        return target.lm_head.weight.index_select(0, self.draft_to_target())


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
    device = target.embed_tokens.weight.device
    return (
        model.to(device=device, dtype=torch.float32 if device.type == "cpu" else target.embed_tokens.weight.dtype)
        .eval()
        .requires_grad_(False)
    )


class DFlashDrafter:
    """The drafter protocol (engine/drafters.py) over a DFlash model and its context cache; on the
    compiled CPU kernels its linear weights are int8 with `quantize`."""

    name = "dflash"

    def __init__(
        self, model: DFlashModel, target: Transformer, max_batch_size: int, max_seq_len: int, quantize: bool = False
    ) -> None:
        self.model = model
        self.target = target
        self.config = model.config
        self.capture_layers: tuple[int, ...] = self.config.target_layer_ids
        param = model.fc.weight
        # Beside a target on the compiled kernels, the drafter runs on them too (float32 activations,
        # keys position-minor); the block's keys and values are written past the context, hence the room.
        lib = native.library() if target.native is not None and native.available(param.device, param.dtype) else None
        positions = max_seq_len + self.config.block_size
        self.native = NativeDFlash(model, target, lib, positions + 1, int8=quantize) if lib and target.native else None
        # One "layer" of the cache per draft layer: the context keys and values it attends to.
        self.cache = KVCache(
            self.config.num_layers,
            max_batch_size,
            positions,
            self.config.num_kv_heads,
            self.config.head_dim,
            dtype=torch.float32 if self.native else param.dtype,
            device=param.device,
            transposed_keys=self.native is not None,
        )
        self.max_k = self.config.block_size - 1
        self.draft_ids = model.draft_to_target()  # the target id of each draft-vocabulary logit
        # The LM head rows of the draft vocabulary, gathered once (the kernels pack their own copy).
        reduced = self.config.draft_vocab_size < self.config.vocab_size
        self.head_rows = model.head(target) if reduced and self.native is None else None
        # Block graphs, shared by every runtime state; set by the engine where the backend has graphs.
        self.graphs: CallGraphs | None = None
        # The extend after a verify of width k + 1, keyed by that width, captured with state k (`capture_extend`).
        self.extend_graphs: dict[int, CallGraphs] = {}
        # A windowed drafter makes no context entries its window will never reach (`_extend`).
        self.skip_before_window = True

    def admit(self, seqs: Seq[Sequence], hidden: dict[int, Tensor]) -> None:
        """New sequences, with the target's tapped hidden states of their prompts (rows in order)."""
        for seq in seqs:
            seq.draft_slot = self.cache.allocate()
        # Every token but the newest went through the target.
        self._extend(seqs, [len(seq.tokens) - 1 for seq in seqs], hidden)

    def accept(self, seqs: Seq[Sequence], accepted: Seq[int], hidden: dict[int, Tensor]) -> None:
        """The verify forward's tapped hidden states (rows in `seqs`' order) of the pending token and
        the kept drafts become context. Nothing speculative was ever added, so nothing rolls back."""
        self._extend(seqs, [kept + 1 for kept in accepted], hidden)

    @torch.inference_mode()
    def _extend(self, seqs: Seq[Sequence], counts: Seq[int], hidden: dict[int, Tensor]) -> None:
        """The first counts[r] tapped hidden states of row r (`hidden`: per tap [rows, width, H])
        become the context of seqs[r] at its next positions, all rows in one call."""
        taps = side_by_side(hidden, self.capture_layers)
        graphs = self.extend_graphs.get(taps.shape[1])
        if graphs is not None and seqs:
            rows = [[self.cache.lengths[seq.draft_slot], count, seq.draft_slot] for seq, count in zip(seqs, counts)]
            if graphs.run(taps, torch.tensor(rows, dtype=torch.long, device=taps.device)) is not None:
                for seq, count in zip(seqs, counts):
                    self.cache.lengths[seq.draft_slot] += count
                return
        slots: list[int] = []
        positions: list[int] = []
        pieces = []
        window = self.skip_before_window and self.config.sliding_window
        for row, (seq, count) in enumerate(zip(seqs, counts)):
            slot = seq.draft_slot
            start = self.cache.lengths[slot]
            # A later block ends at least two past this context and sees back `window` from there:
            # entries before that (a long prompt's start) are never seen, and not made.
            skip = min(count, max(0, count + 2 - window)) if window else 0
            slots += [slot] * (count - skip)
            positions += range(start + skip, start + count)
            pieces.append(taps[row, skip:count])
            self.cache.lengths[slot] = start + count
        if not slots:
            return
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if self.native is not None:
            self.native.extend(self.cache, slots, positions, flat.float())
            return
        where = torch.tensor(positions, device=flat.device)
        self.write_context(flat, where, torch.tensor(slots, device=flat.device), where)

    def write_context(self, taps: Tensor, positions: Tensor, slots: Tensor, where: Tensor) -> None:
        """Each draft layer's context keys and values of the tapped hidden states `taps` (side by
        side, [..., taps * H]) at `positions`, written to the cache at (`slots`, `where`)."""
        keys, values = self.model.context(self.model.fused(taps.to(self.model.fc.weight.dtype)), positions)
        for i, (k, v) in enumerate(zip(keys, values)):
            self.cache.k[i, slots, where] = k
            self.cache.v[i, slots, where] = v

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], ks: Seq[int], floor: float = 0.0) -> list[Proposal]:
        # The engine trims a block by its confidences (`Proposal.confidence`): all of them come at once.
        proposals = [Proposal([]) for _ in seqs]
        rows = [i for i, k in enumerate(ks) if k > 0]
        if not rows:
            return proposals
        drafts = min(max(ks[i] for i in rows), self.max_k)
        size = self.block_width(drafts)
        device = self.model.fc.weight.device
        slots = [seqs[i].draft_slot for i in rows]
        block = torch.full((len(rows), size), self.config.mask_token_id, dtype=torch.long, device=device)
        block[:, 0] = torch.tensor([seqs[i].tokens[-1] for i in rows], device=device)
        logits = self.block_logits(slots, block, drafts)
        # A greedy draft's confidence is its probability under the drafter.
        top, choice = logits.softmax(dim=-1).max(dim=-1)
        confidence, choice = top.tolist(), self.draft_ids[choice].tolist()
        for row, i in enumerate(rows):
            seq, k = seqs[i], min(ks[i], self.max_k)
            if seq.params.greedy:
                proposals[i] = Proposal(choice[row][:k], confidence=confidence[row][:k])
            else:
                q = target_probs(logits[row, :k], seq.params)
                tokens = [int(self.draft_ids[sample(q[j], seq.generator)]) for j in range(k)]
                full = self.model.full_probabilities(q, self.draft_ids)
                proposals[i] = Proposal(tokens, full, q.amax(dim=-1).tolist())
        return proposals

    def block_width(self, drafts: int) -> int:
        """Positions of the block that drafts `drafts`: k + 1 for a drafter trained on shorter
        blocks too, else the whole block (as captured graphs always take it)."""
        return drafts + 1 if self.config.short_blocks and self.graphs is None else self.config.block_size

    @torch.inference_mode()
    def block_logits(self, slots: list[int], block: Tensor, drafts: int) -> Tensor:
        """Logits [rows, drafts, draft vocab] of block positions 1..drafts, each row's block
        ([rows, width] token ids: a whole block, or a shorter one) after the context of its cache slot."""
        if self.native is not None:
            return self.native.block(self.cache, slots, block, drafts)
        size, device = block.shape[1], block.device
        if self.graphs is not None:
            where = torch.tensor([[self.cache.lengths[s] for s in slots], slots], dtype=torch.long, device=device).T
            out = self.graphs.run(torch.cat((block, where), dim=1))
            if out is not None:
                return out[0][:, :drafts]
        lengths = torch.tensor([self.cache.lengths[s] for s in slots], device=device)
        width = int(lengths.max())
        positions = lengths[:, None] + torch.arange(size, device=device)[None, :]
        index = torch.tensor(slots, device=device)
        context_k = [self.cache.k[layer, index, :width] for layer in range(self.config.num_layers)]
        context_v = [self.cache.v[layer, index, :width] for layer in range(self.config.num_layers)]
        mask = block_mask(lengths, width, size, self.config.sliding_window)
        return self.model(block, positions, context_k, context_v, mask, self.target, drafts, self.head_rows)

    def capture_graphs(self, backend: Backend, batch_sizes: Seq[int]) -> CallGraphs:
        """The block forward (`static_block`) captured for each batch size. A padding row is a
        block of mask tokens after slot 0's empty context: the block writes nothing."""
        device, size = self.model.fc.weight.device, self.config.block_size

        def padding(batch_size: int) -> tuple[Tensor]:
            inputs = torch.full((batch_size, size + 2), self.config.mask_token_id, dtype=torch.long, device=device)
            inputs[:, size:] = 0
            return (inputs,)

        return CallGraphs(backend, batch_sizes, padding, self.static_block)

    def capture_extend(self, backend: Backend, batch_sizes: Seq[int], width: int) -> CallGraphs:
        """The extend after a verify of `width` tokens (`static_extend`) captured for each batch
        size. A padding row has no positions to keep: it writes only slot 0's scratch position."""
        device = self.model.fc.weight.device
        taps = len(self.capture_layers) * self.config.hidden_size
        dtype = self.target.embed_tokens.weight.dtype  # the target's hidden states

        def padding(batch_size: int) -> tuple[Tensor, Tensor]:
            inputs = torch.zeros(batch_size, width, taps, dtype=dtype, device=device)
            return inputs, torch.zeros(batch_size, 3, dtype=torch.long, device=device)

        return CallGraphs(backend, batch_sizes, padding, self.static_extend)

    def static_extend(self, taps: Tensor, rows: Tensor) -> tuple[Tensor]:
        """`_extend` with device ops only, at fixed shapes (what a graph captures): the tapped
        hidden states `taps` [rows, W, taps * H] beside `rows` [rows, 3] = (the slot's context
        length, how many of the W positions become context, the slot). The positions past a
        row's count write its slot's scratch position, never visible. Returns where each went."""
        starts, counts, slots = rows.unbind(-1)
        offsets = torch.arange(taps.shape[1], device=taps.device)[None, :]
        positions = starts[:, None] + offsets
        where = torch.where(offsets < counts[:, None], positions, self.cache.scratch_pos)
        self.write_context(taps, positions, slots[:, None].expand_as(where), where)
        return (where,)

    def static_block(self, inputs: Tensor) -> tuple[Tensor]:
        """`block_logits` of every draft with device ops only, at fixed shapes (what a graph
        captures): rows `inputs` [rows, B + 2] = (the block, its context length, its slot), each
        block attending over its slot's whole cache row, masked past the context."""
        size, cache = self.config.block_size, self.cache
        block, lengths, slots = inputs[:, :size], inputs[:, size], inputs[:, size + 1]
        positions = lengths[:, None] + torch.arange(size, device=inputs.device)[None, :]
        width = cache.max_seq_len + 1
        context_k = [cache.k[layer, slots] for layer in range(self.config.num_layers)]
        context_v = [cache.v[layer, slots] for layer in range(self.config.num_layers)]
        mask = block_mask(lengths, width, size, self.config.sliding_window)
        return (self.model(block, positions, context_k, context_v, mask, self.target, size - 1, self.head_rows),)

    def release(self, seq: Sequence) -> None:
        if seq.draft_slot is not None:
            self.cache.release(seq.draft_slot)
            seq.draft_slot = None


class HybridDFlashDrafter(LookupFirst, DFlashDrafter):
    """Prompt lookup in front of the DFlash drafter (`LookupFirst`): a round whose sequences all
    found a continuation in their context runs no drafter forward. The context is kept from the
    target's hidden states whichever proposed, so nothing catches up."""

    name = "hybrid_dflash"
