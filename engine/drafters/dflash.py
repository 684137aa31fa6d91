"""DFlash drafting: a block of drafts in one forward of the block drafter (engine/model/dflash.py).

The drafter keeps, per sequence, every draft layer's keys and values of the context (the target's
tapped hidden states of the tokens it kept; only kept tokens enter, so nothing rolls back). A
draft is one forward of the block [last accepted token, mask x (B-1)]; the outputs at block
positions 1..k are the drafts. Beside a target on the compiled CPU kernels, both the context
and the block run on them (engine/native/dflash.py); elsewhere on PyTorch operators.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from engine.confidence import EVERY_DRAFT, ConfidenceRule
from engine.device.backend import Backend
from engine.device.graphs import CallGraphs
from engine.drafters.base import Drafter, Proposal
from engine.drafters.ngram import LookupFirst
from engine.model.dflash import DFlashModel, block_mask
from engine.model.kv_cache import KVCache
from engine.model.transformer import Transformer, side_by_side
from engine.native.build import available, library
from engine.native.dflash import NativeDFlash
from engine.request import Sequence
from engine.sampling import draw_rows, sample, target_probs


class DFlashDrafter(Drafter):
    """The drafter protocol (engine/drafters/base.py) over a DFlash model and its context cache; on the
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
        lib = library() if target.native is not None and available(param.device, param.dtype) else None
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
        # Block graphs, shared by every runtime state, captured with the first that drafts (`capture`).
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
    def propose(self, seqs: Seq[Sequence], ks: Seq[int], rule: ConfidenceRule = EVERY_DRAFT) -> list[Proposal]:
        # The whole block comes at once: the engine cuts it by the confidences it reports.
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
        # A draft's confidence: the product of the drafter's largest probabilities at its position
        # and those before it, which it drafted side by side, not one from another.
        top, choice = logits.softmax(dim=-1).max(dim=-1)
        confidence, choice = top.cumprod(dim=-1).tolist(), self.draft_ids[choice].tolist()
        sampled = [row for row, i in enumerate(rows) if not seqs[i].params.greedy] if self.samples_on_device else []
        if sampled:
            chosen = [rows[row] for row in sampled]
            drawn = self.sample_blocks(
                [seqs[i] for i in chosen], logits[sampled], [min(ks[i], self.max_k) for i in chosen]
            )
            for i, proposal in zip(chosen, drawn):
                proposals[i] = proposal
        for row, i in enumerate(rows):
            seq, k = seqs[i], min(ks[i], self.max_k)
            if seq.params.greedy:
                proposals[i] = Proposal(choice[row][:k], confidence=confidence[row][:k])
            elif row not in sampled:
                q = target_probs(logits[row, :k], seq.params)
                tokens = [int(self.draft_ids[sample(q[j], seq.generator)]) for j in range(k)]
                full = self.model.full_probabilities(q, self.draft_ids)
                proposals[i] = Proposal(tokens, full, q.amax(dim=-1).cumprod(dim=-1).tolist())
        return proposals

    def sample_blocks(self, seqs: Seq[Sequence], logits: Tensor, ks: Seq[int]) -> list[Proposal]:
        """Sampled rows' first ks[row] drafts drawn together with device operators (logits [rows,
        drafts, draft vocab]), every draw from the row's own generator: one read back for them all."""
        ids, q = draw_rows(logits, [s.params for s in seqs], [s.generator for s in seqs])
        drawn = self.draft_ids[ids]
        confidence = q.amax(dim=-1).cumprod(dim=-1).double()
        tokens, confidence = torch.stack((drawn.double(), confidence)).tolist()
        full = self.model.full_probabilities(q, self.draft_ids)
        return [Proposal([int(t) for t in tokens[r][:k]], full[r, :k], confidence[r][:k]) for r, k in enumerate(ks)]

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

    def capture(self, k: int, backend: Backend, batch_sizes: Seq[int]) -> int:
        """State k's extend after a verify of k + 1 (at k = 0 too: the context still takes in each
        round's token), and the block forward every drafting state shares if none has captured it."""
        memory = 0
        if k > 0 and self.graphs is None:
            self.graphs = self.capture_graphs(backend, batch_sizes)
            memory += self.graphs.memory_bytes
        extend = self.extend_graphs[k + 1] = self.capture_extend(backend, batch_sizes, k + 1)
        return memory + extend.memory_bytes

    @property
    def graph_captures(self) -> int:
        sets = [self.graphs, *self.extend_graphs.values()]
        return sum(graphs.captures for graphs in sets if graphs is not None)

    def release(self, seq: Sequence) -> None:
        if seq.draft_slot is not None:
            self.cache.release(seq.draft_slot)
            seq.draft_slot = None


class HybridDFlashDrafter(LookupFirst, DFlashDrafter):
    """Prompt lookup in front of the DFlash drafter (`LookupFirst`): a round whose sequences all
    found a continuation in their context runs no drafter forward. The context is kept from the
    target's hidden states whichever proposed, so nothing catches up."""

    name = "hybrid_dflash"
