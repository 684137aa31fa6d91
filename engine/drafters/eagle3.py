"""EAGLE-3 drafting: chains from the head (engine/model/eagle3.py) over the target's own hidden states.

A chain feeds the layer's output back as the next position's feature, beside the embedding
of the token it just drafted, as SGLang's topk = 1 EAGLE worker does.

Per sequence the head keeps its own keys and values: one entry per position the target has
verified (from the target's features), then the current chain's entries past them, overwritten
by the next round. The kept positions of each verify become entries when the sequence next
drafts (the draft-extend: a sequence served at k = 0 costs the head nothing), and the last
one's output is already the chain's first draft.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.confidence import EVERY_DRAFT, ConfidenceRule
from engine.device.backend import Backend
from engine.device.graphs import CallGraphs
from engine.drafters.base import Drafter, Proposal
from engine.drafters.ngram import LookupFirst
from engine.model.eagle3 import Eagle3Model
from engine.model.kv_cache import KVCache
from engine.model.transformer import Transformer, side_by_side, visible_keys
from engine.native.build import available, library
from engine.native.eagle3 import NativeEagle3, Sampling
from engine.request import Sequence
from engine.sampling import RowSampling, draw_by_row, probs_by_row, sample, target_probs, uniforms


class Extend(NamedTuple):
    """A draft-extend: tokens[t] beside the target's taps[t] become entries of slots[t] at
    positions[t]; the `selected` ones (each sequence's last) finish the layer. In the order of
    `Eagle3Drafter.step`'s arguments."""

    tokens: list[int]
    taps: Tensor
    slots: list[int]
    positions: list[int]
    selected: list[int]


def top_probability(logits: Tensor) -> Tensor:
    """Each row's largest probability: a greedy draft's own under the head, what a chain stops by
    (the kernels' `top_probability`)."""
    return logits.float().softmax(dim=-1).amax(dim=-1)


def place_chains(proposals: list[Proposal], rows: list[int], steps: Seq[int], drafts: Seq[list[int]]) -> None:
    """Each row's compiled chain as its proposal: the drafts, and as trimmed those short of the
    steps + 1 it was asked for (a chain stops only at a draft the head is unsure of)."""
    for i, n, tokens in zip(rows, steps, drafts):
        proposals[i].tokens, proposals[i].trimmed = tokens, n + 1 - len(tokens)


class Eagle3Drafter(Drafter):
    """The drafter protocol (engine/drafters/base.py) over an EAGLE-3 head and its own cache. Beside a
    target on the compiled CPU kernels the head runs on them too (engine/native/eagle3.py), its
    linear weights in int8 with `quantize`, else in bfloat16."""

    name = "eagle3"

    def __init__(
        self, model: Eagle3Model, target: Transformer, max_batch_size: int, max_seq_len: int, quantize: bool = False
    ) -> None:
        self.model = model
        self.target = target
        self.capture_layers: tuple[int, ...] = model.taps
        config, param = model.config, model.fc.weight
        lib = library() if target.native is not None and available(param.device, param.dtype) else None
        self.native = (
            NativeEagle3(model, target.native, lib, max_seq_len + 1, int8=quantize) if lib and target.native else None
        )
        self.cache = KVCache(
            1,
            max_batch_size,
            max_seq_len,
            config.num_kv_heads,
            config.head_dim,
            dtype=torch.float32 if self.native else param.dtype,
            device=param.device,
            transposed_keys=self.native is not None,
        )
        # Per slot: the draft-vocabulary logits and output feature of its last verified position,
        # whose argmax is the next chain's first draft. Logits stay in the draft vocabulary: a
        # greedy chain maps only its argmax to a target id (`draft_ids`), never a whole row.
        self.next_logits = torch.zeros(max_batch_size, config.draft_vocab_size, dtype=param.dtype, device=param.device)
        self.draft_ids = model.draft_to_target()
        self.next_feature = torch.zeros(max_batch_size, config.hidden_size, dtype=param.dtype, device=param.device)
        # Per slot: tapped hidden states not yet entries, as (taps, row, count): row's first count.
        self.waiting: dict[int, list[tuple[Tensor, int, int]]] = {}
        # Chain-step graphs, shared by every runtime state, captured with the first that drafts (`capture`).
        self.graphs: CallGraphs | None = None
        # Greedy chains of k drafts whole, one set per k, captured with state k (`capture_chain`).
        self.chain_graphs: dict[int, CallGraphs] = {}
        # Sampled chains of k drafts whole, drawn on the device, where the engine samples there
        # (`capture_sampled_chain`).
        self.sampled_chain_graphs: dict[int, CallGraphs] = {}
        # The draft-extend after a verify of width k + 1, keyed by that width, captured with state k
        # (`capture_extend`): eagerly it is a dozen operators and a host read a round.
        self.extend_graphs: dict[int, CallGraphs] = {}
        # Where the head runs on the compiled kernels, a greedy round's extend and chains are one call.
        self.rounds_in_one_call = self.native is not None and self.next_feature.dtype == torch.float32
        # Sampled chains drawn in the kernels too (a step from Python costs about as much as the
        # step itself); a request with top-k keeps the step-by-step path.
        self.sampled_in_kernels = self.native is not None
        # A windowed head makes no entries its window will never reach (`take_held`).
        self.skip_before_window = True

    def admit(self, seqs: Seq[Sequence], hidden: dict[int, Tensor]) -> None:
        """New sequences, with the target's tapped hidden states of their prompts (rows in order)."""
        for seq in seqs:
            seq.draft_slot = self.cache.allocate()
        self.hold(seqs, [len(seq.tokens) - 1 for seq in seqs], hidden)  # all but the newest went through

    def accept(self, seqs: Seq[Sequence], accepted: Seq[int], hidden: dict[int, Tensor]) -> None:
        """The pending token and the kept drafts are to become entries (from the verify's hidden
        states); the chain's own entries past them will be overwritten."""
        self.hold(seqs, [kept + 1 for kept in accepted], hidden)

    def hold(self, seqs: Seq[Sequence], counts: Seq[int], hidden: dict[int, Tensor]) -> None:
        """Keep row r's first counts[r] tapped hidden states (`hidden`: per tap [rows, width, H])
        until seqs[r] next drafts: a sequence served at k = 0 costs the head nothing."""
        taps = side_by_side(hidden, self.capture_layers)  # never a graph's buffer, which its next replay overwrites
        for row, (seq, count) in enumerate(zip(seqs, counts)):
            if count > 0:
                self.waiting.setdefault(seq.draft_slot, []).append((taps, row, count))

    def take_held(self, seqs: Seq[Sequence]) -> Extend | None:
        """The draft-extend that makes the held hidden states of `seqs` entries at their next
        positions (their cache lengths move past them), or None where none is held."""
        slots, positions, tokens, pieces, selected = [], [], [], [], []
        window = self.skip_before_window and self.model.config.sliding_window
        for seq in seqs:
            held = self.waiting.pop(seq.draft_slot, None)
            if not held:
                continue
            start, count = self.cache.lengths[seq.draft_slot], sum(n for _, _, n in held)
            # Entries before the window of the last held position are never seen by it or any
            # later one (a long prompt's start, for a windowed head): they are not made.
            skip = max(0, count - window) if window else 0
            slots += [seq.draft_slot] * (count - skip)
            positions += range(start + skip, start + count)
            tokens += seq.tokens[start + skip + 1 : start + count + 1]  # position p reads token p + 1
            for taps, row, n in held:
                if n > skip:
                    pieces.append(taps[row, skip:n])
                skip = max(0, skip - n)
            selected.append(len(slots) - 1)
            self.cache.lengths[seq.draft_slot] = start + count
        if not slots:
            return None
        return Extend(tokens, pieces[0] if len(pieces) == 1 else torch.cat(pieces), slots, positions, selected)

    @torch.inference_mode()
    def catch_up(self, seqs: Seq[Sequence]) -> None:
        """The held hidden states of `seqs` become entries at their next positions, every
        sequence in one step (the draft-extend); each sequence's last one gives its next draft."""
        self.graph_extend(seqs)
        extend = self.take_held(seqs)
        if extend is not None:
            self.step(*extend, taps=True)

    def draft(self, slots: list[int], tokens: list[int], step: int) -> Tensor:
        """One draft step: each slot's chain entry `step` past its verified ones, reading the token
        just drafted and the feature its last step output. The draft-vocabulary logits of the next
        draft [rows, draft vocab]."""
        positions = [self.cache.lengths[s] + step for s in slots]
        if self.graphs is not None:
            inputs = torch.tensor([tokens, positions, slots], dtype=torch.long).T
            out = self.graphs.run(inputs, self.next_feature[slots])
            if out is not None:
                self.next_feature[slots], self.next_logits[slots] = out
                return self.next_logits[slots]
        return self.step(tokens, self.next_feature[slots], slots, positions, list(range(len(slots))))

    def capture_graphs(self, backend: Backend, batch_sizes: Seq[int]) -> CallGraphs:
        """The chain step (`static_draft`) captured for each batch size. A padding row drafts
        token 0 at slot 0's scratch position, which no real row ever reads."""
        device, hidden = self.next_feature.device, self.model.config.hidden_size

        def padding(batch_size: int) -> tuple[Tensor, Tensor]:
            inputs = torch.zeros(batch_size, 3, dtype=torch.long, device=device)
            inputs[:, 1] = self.cache.scratch_pos
            return inputs, torch.zeros(batch_size, hidden, dtype=self.next_feature.dtype, device=device)

        return CallGraphs(backend, batch_sizes, padding, self.static_draft)

    def graph_extend(self, seqs: Seq[Sequence]) -> None:
        """The draft-extend of those `seqs` whose held hidden states are one verify's rows, in one
        replay of that verify width's graph; the rest (a prompt, rounds at k = 0 since, a batch
        over every bucket) stay held for the eager `step`."""
        if not self.extend_graphs:
            return
        rows, taps = [], None
        for seq in seqs:
            held = self.waiting.get(seq.draft_slot)
            if held and len(held) == 1 and (taps is None or held[0][0] is taps):
                taps = held[0][0]
                rows.append(seq)
        graphs = self.extend_graphs.get(taps.shape[1]) if taps is not None else None
        if graphs is None:
            return
        width = taps.shape[1]
        inputs, picked = [], []
        for seq in rows:
            _, row, count = self.waiting[seq.draft_slot][0]
            start = self.cache.lengths[seq.draft_slot]
            tokens = list(seq.tokens[start + 1 : start + count + 1])  # position p reads token p + 1
            inputs.append(tokens + [0] * (width - count) + [start, count, seq.draft_slot])
            picked.append(row)
        if picked != list(range(taps.shape[0])):
            taps = taps[torch.tensor(picked, device=taps.device)]
        out = graphs.run(taps, torch.tensor(inputs, dtype=torch.long, device=taps.device))
        if out is None:
            return
        feature, logits, slots = out
        self.next_feature.index_copy_(0, slots, feature.to(self.next_feature.dtype))
        self.next_logits.index_copy_(0, slots, logits.to(self.next_logits.dtype))
        for seq in rows:
            _, _, count = self.waiting.pop(seq.draft_slot)[0]
            self.cache.lengths[seq.draft_slot] += count

    def capture_extend(self, backend: Backend, batch_sizes: Seq[int], width: int) -> CallGraphs:
        """The draft-extend after a verify of `width` tokens (`static_extend`) captured for each
        batch size. A padding row keeps none of its positions: it writes only slot 0's scratch."""
        device = self.next_feature.device
        dtype = self.target.embed_tokens.weight.dtype  # the target's hidden states

        def padding(batch_size: int) -> tuple[Tensor, Tensor]:
            taps = torch.zeros(batch_size, width, self.model.fc.in_features, dtype=dtype, device=device)
            return taps, torch.zeros(batch_size, width + 3, dtype=torch.long, device=device)

        return CallGraphs(backend, batch_sizes, padding, self.static_extend)

    def static_extend(self, taps: Tensor, inputs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The draft-extend with device ops only, at fixed shapes (what a graph captures): the
        tapped hidden states `taps` [rows, W, taps * H] beside `inputs` [rows, W + 3] = (the token
        each position reads, the slot's entries, how many of the W positions become entries, the
        slot). Positions past a row's count write its slot's scratch position. Returns the output
        feature and draft-vocabulary logits of each row's last entry, and the rows' slots."""
        model, cache = self.model, self.cache
        width = taps.shape[1]
        tokens, (starts, counts, slots) = inputs[:, :width], inputs[:, width:].unbind(-1)
        offsets = torch.arange(width, device=inputs.device)[None, :]
        positions = starts[:, None] + offsets
        where = torch.where(offsets < counts[:, None], positions, cache.scratch_pos)
        features = model.features(taps.to(model.fc.weight.dtype))
        q, k, v = model.qkv(self.target.embed_tokens(tokens).to(features.dtype), features, positions)
        cache.k[0, slots[:, None], where] = k
        cache.v[0, slots[:, None], where] = v
        rows = torch.arange(inputs.shape[0], device=inputs.device)
        last = (counts - 1).clamp(min=0)  # a padding row keeps nothing: its first position stands in
        keys, values = cache.k[0, slots].transpose(1, 2), cache.v[0, slots].transpose(1, 2)
        key_positions = torch.arange(cache.max_seq_len + 1, device=inputs.device)
        ends = (starts + last)[:, None]
        mask = visible_keys(ends, key_positions[None, :], model.config.sliding_window)[:, None, None, :]
        query = q[rows, last][:, :, None]
        attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
        out = model.finish(attended[:, :, 0], features[rows, last])
        return out, model.draft_logits(out), slots

    def capture_chain(self, backend: Backend, batch_sizes: Seq[int], k: int) -> CallGraphs:
        """A greedy chain of k drafts (`static_chain`) captured for each batch size: a round then
        costs one replay and one read back, where a step at a time costs a replay, a few eager
        operators and a read back per draft. A padding row chains at slot 0's scratch position."""
        device = self.next_feature.device

        def padding(batch_size: int) -> tuple[Tensor]:
            inputs = torch.zeros(batch_size, 2, dtype=torch.long, device=device)
            inputs[:, 0] = self.cache.scratch_pos
            return (inputs,)

        return CallGraphs(backend, batch_sizes, padding, partial(self.static_chain, steps=k - 1))

    def capture_sampled_chain(self, backend: Backend, batch_sizes: Seq[int], k: int) -> CallGraphs:
        """A sampled chain of k drafts (`static_sampled_chain`) captured for each batch size. A
        padding row chains at slot 0's scratch position, at temperature 1 with every token."""
        device = self.next_feature.device

        def padding(batch_size: int) -> tuple[Tensor, ...]:
            inputs = torch.zeros(batch_size, 2, dtype=torch.long, device=device)
            inputs[:, 0] = self.cache.scratch_pos
            drawn = torch.zeros(batch_size, k, dtype=torch.float64, device=device)
            ones = torch.ones(batch_size, device=device)
            return inputs, drawn, ones, torch.zeros(batch_size, dtype=torch.long, device=device), ones.clone()

        return CallGraphs(backend, batch_sizes, padding, partial(self.static_sampled_chain, steps=k - 1))

    def static_sampled_chain(
        self, inputs: Tensor, drawn: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, steps: int
    ) -> tuple[Tensor, Tensor]:
        """`static_chain` with each draft drawn, not chosen: row i's draft j from its
        probabilities under its own temperature, top_k and top_p, at its uniform drawn[i, j].
        Returns the drafts' target ids [rows, steps + 1] and their draft-vocabulary
        probabilities [rows, steps + 1, draft vocab], which the rejection rule reads."""
        starts, slots = inputs.unbind(-1)
        rows = RowSampling(temperature, top_k, top_p)
        features, logits = self.next_feature[slots], self.next_logits[slots]
        drafts, probs = [], []
        for step in range(steps + 1):
            if step:
                positions = (starts + step - 1).clamp(max=self.cache.scratch_pos)
                features, logits = self.static_draft(torch.stack((drafts[-1], positions, slots), dim=-1), features)
            q = probs_by_row(logits, rows)
            drafts.append(self.draft_ids[draw_by_row(q, drawn[:, step])])
            probs.append(q)
        return torch.stack(drafts, dim=-1), torch.stack(probs, dim=1)

    def static_chain(self, inputs: Tensor, steps: int) -> tuple[Tensor]:
        """A greedy chain with device ops only (what a graph captures): rows `inputs` [rows, 2] =
        (the slot's entries, the slot). The first draft is the argmax of the slot's next logits,
        each of the `steps` later ones that of a chain step reading the draft before it. Returns
        the drafts' target ids [rows, steps + 1]."""
        starts, slots = inputs.unbind(-1)
        features = self.next_feature[slots]
        token = self.draft_ids[self.next_logits[slots].argmax(dim=-1)]
        drafts = [token]
        for step in range(steps):
            positions = (starts + step).clamp(max=self.cache.scratch_pos)  # padding rows stay on scratch
            features, logits = self.static_draft(torch.stack((token, positions, slots), dim=-1), features)
            token = self.draft_ids[logits.argmax(dim=-1)]
            drafts.append(token)
        return (torch.stack(drafts, dim=-1),)

    def static_draft(self, inputs: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        """The chain step with device ops only, at fixed shapes (what a graph captures): rows
        `inputs` [rows, 3] = (token, position, slot) beside `features` [rows, H]. Each query
        attends over its slot's whole cache row, masked past its position, so the key length never
        changes. Returns the output features and the draft-vocabulary logits."""
        model, cache = self.model, self.cache
        tokens, positions, slots = inputs.unbind(-1)
        embeds = self.target.embed_tokens(tokens).to(features.dtype)
        q, k, v = model.qkv(embeds, features, positions)
        cache.k[0, slots, positions] = k
        cache.v[0, slots, positions] = v
        keys, values = cache.k[0, slots].transpose(1, 2), cache.v[0, slots].transpose(1, 2)
        key_positions = torch.arange(cache.max_seq_len + 1, device=inputs.device)
        mask = visible_keys(positions[:, None], key_positions[None, :], model.config.sliding_window)[:, None, None, :]
        attended = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, enable_gqa=True)
        out = model.finish(attended[:, :, 0], features)
        return out, model.draft_logits(out)

    def step(
        self,
        tokens: list[int],
        features: Tensor,
        slots: list[int],
        positions: list[int],
        selected: list[int],
        taps: bool = False,
    ) -> Tensor:
        """Entries for each token (reading tokens[t] beside features[t], or beside the feature fc
        makes of the tapped hidden states features[t] with `taps`) at slots[t], positions[t]; the
        `selected` ones attend to their slot up to there and finish the layer, their output
        features and logits becoming their slots' next. Returns those logits [selected, draft vocab]."""
        model, device = self.model, self.model.fc.weight.device
        chosen = [slots[t] for t in selected]
        if self.native is not None:
            out, logits = self.native.step(self.cache, tokens, features, slots, positions, selected, taps)
        else:
            if taps:
                features = model.features(features.to(model.fc.weight.dtype))
            embeds = self.target.embed_tokens(torch.tensor(tokens, device=device)).to(features.dtype)
            where = torch.tensor(positions, device=device)
            q, k, v = model.qkv(embeds, features, where)
            index = torch.tensor(slots, device=device)
            self.cache.k[0, index, where] = k
            self.cache.v[0, index, where] = v
            rows, ends = torch.tensor(chosen, device=device), where[selected]
            width = int(ends.max()) + 1
            keys = self.cache.k[0, rows, :width].transpose(1, 2)
            values = self.cache.v[0, rows, :width].transpose(1, 2)
            key_positions = torch.arange(width, device=device)[None, :]
            mask = visible_keys(ends[:, None], key_positions, model.config.sliding_window)[:, None, None, :]
            attended = F.scaled_dot_product_attention(
                q[selected][:, :, None], keys, values, attn_mask=mask, enable_gqa=True
            )
            out = model.finish(attended[:, :, 0], features[selected])
            logits = model.draft_logits(out)
        self.next_logits[chosen] = logits.to(self.next_logits.dtype)
        self.next_feature[chosen] = out.to(self.next_feature.dtype)
        return logits

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], ks: Seq[int], rule: ConfidenceRule = EVERY_DRAFT) -> list[Proposal]:
        """Each row's chain; a greedy one stops at the first draft `rule` does not keep, its
        confidence being the probability the head gave it (each draft alone: the head is
        under-confident, trained on the target's soft distribution, so a running product of its
        probabilities would stop nearly every chain early). Sampled chains, and chains replayed
        from a captured graph, run whole."""
        proposals = [Proposal([]) for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        if not active:
            return proposals
        self.graph_extend([seqs[i] for i in active])
        extend = self.take_held([seqs[i] for i in active])
        greedy = [i for i in active if seqs[i].params.greedy]
        if self.rounds_in_one_call and extend is not None and len(greedy) == len(extend.selected) == len(active):
            # Every row greedy and caught up here: the extend and the chains in one call.
            self.native_round(seqs, ks, active, extend, proposals, rule)
            return proposals
        if extend is not None:
            self.step(*extend, taps=True)
        if greedy and self.native is not None and self.graphs is None:
            # Greedy chains run whole in the kernels: a step from Python costs a third again of its arithmetic.
            self.native_chains(seqs, ks, greedy, proposals, rule)
            active = [i for i in active if not seqs[i].params.greedy]
        elif greedy and self.graph_chains(seqs, ks, greedy, proposals):
            active = [i for i in active if not seqs[i].params.greedy]
        sampled = [i for i in active if not seqs[i].params.greedy]
        if sampled and self.sampled_chain_graphs and self.graph_sampled_chains(seqs, ks, sampled, proposals):
            active = [i for i in active if seqs[i].params.greedy]
        if self.sampled_in_kernels and self.graphs is None:
            drawn = [i for i in active if not seqs[i].params.greedy and not seqs[i].params.top_k]
            if drawn:
                self.native_sampled_chains(seqs, ks, drawn, proposals)
                active = [i for i in active if i not in drawn]
        if active:
            # Where chains replay from captured graphs, none stops: one a step at a time would not either.
            self.chains(seqs, ks, active, proposals, rule if self.graphs is None else EVERY_DRAFT)
        return proposals

    def native_round(
        self,
        seqs: Seq[Sequence],
        ks: Seq[int],
        rows: list[int],
        extend: Extend,
        proposals: list[Proposal],
        rule: ConfidenceRule,
    ) -> None:
        """The draft-extend and the greedy chains of seqs[rows] in one call to the compiled kernels."""
        assert self.native is not None
        steps = self.chain_steps(ks, rows, [self.cache.lengths[seqs[i].draft_slot] for i in rows])
        drafts = self.native.round(
            self.cache,
            extend.tokens,
            extend.taps,
            extend.slots,
            extend.positions,
            extend.selected,
            steps,
            self.draft_ids,
            self.next_feature,
            self.next_logits,
            rule.floor,
        )
        place_chains(proposals, rows, steps, drafts)

    def chain_steps(self, ks: Seq[int], rows: list[int], starts: list[int]) -> list[int]:
        """Steps after the first draft of each row's compiled chain, as the step-by-step chain
        takes them: ks[i] - 1, while the cache has room past the row's `starts` entries."""
        return [max(0, min(ks[i] - 1, self.cache.max_seq_len - start)) for i, start in zip(rows, starts)]

    def native_chains(
        self, seqs: Seq[Sequence], ks: Seq[int], rows: list[int], proposals: list[Proposal], rule: ConfidenceRule
    ) -> None:
        """Greedy chains for seqs[rows] in one call to the compiled kernels, each stopping at
        the first draft `rule` does not keep."""
        assert self.native is not None
        slots = [seqs[i].draft_slot for i in rows]
        starts = [self.cache.lengths[s] for s in slots]
        steps = self.chain_steps(ks, rows, starts)
        logits = self.next_logits[slots]
        first = self.draft_ids[logits.argmax(dim=-1)].tolist()
        first_kept = [rule.keeps(p) for p in top_probability(logits).tolist()] if rule.floor > 0 else None
        features = self.next_feature[slots]
        drafts = self.native.chain(
            self.cache, slots, starts, steps, first, features, self.draft_ids, floor=rule.floor, first_kept=first_kept
        )
        place_chains(proposals, rows, steps, drafts)

    def native_sampled_chains(
        self, seqs: Seq[Sequence], ks: Seq[int], rows: list[int], proposals: list[Proposal]
    ) -> None:
        """Sampled chains for seqs[rows] in one call to the compiled kernels: each row's first
        draft drawn here from its slot's next logits, the rest there, every draw from the row's
        own generator, with the probabilities the rejection rule reads."""
        assert self.native is not None
        slots = [seqs[i].draft_slot for i in rows]
        starts = [self.cache.lengths[s] for s in slots]
        steps = self.chain_steps(ks, rows, starts)
        width = max(steps) + 1
        probs = torch.zeros(len(rows), width, self.model.config.draft_vocab_size)
        uniforms = torch.zeros(len(rows), width, dtype=torch.float64)
        logits, first = self.next_logits[slots].float(), []
        for row, (i, n) in enumerate(zip(rows, steps)):
            seq = seqs[i]
            probs[row, 0] = target_probs(logits[row], seq.params)
            first.append(int(self.draft_ids[sample(probs[row, 0], seq.generator)]))
            uniforms[row, 1 : n + 1] = torch.rand(n, generator=seq.generator, dtype=torch.float64)
        params = [seqs[i].params for i in rows]
        inv_temperature = torch.tensor([1 / p.temperature for p in params], dtype=torch.float32)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        sampling = Sampling(inv_temperature, top_p, uniforms, probs)
        features = self.next_feature[slots]
        drafts = self.native.chain(self.cache, slots, starts, steps, first, features, self.draft_ids, sampling)
        for row, (i, tokens) in enumerate(zip(rows, drafts)):
            proposals[i].tokens = tokens
            proposals[i].probs = self.model.full_probabilities(probs[row, : len(tokens)], self.draft_ids)

    def graph_chains(self, seqs: Seq[Sequence], ks: Seq[int], rows: list[int], proposals: list[Proposal]) -> bool:
        """Greedy chains for seqs[rows] in one replay of the longest one's chain graph, each row
        keeping its own ks[i] drafts; False where none serves them (no graph for that k, a batch
        over every bucket, or a chain that would run past the cache: the step path stops there)."""
        k = max(ks[i] for i in rows)
        graphs = self.chain_graphs.get(k)
        slots = [seqs[i].draft_slot for i in rows]
        starts = [self.cache.lengths[s] for s in slots]
        if graphs is None or max(starts) + k - 2 >= self.cache.max_seq_len:
            return False
        out = graphs.run(torch.tensor([starts, slots], dtype=torch.long, device=self.next_feature.device).T)
        if out is None:
            return False
        for i, drafts in zip(rows, out[0].tolist()):
            proposals[i].tokens = drafts[: ks[i]]
        return True

    def graph_sampled_chains(
        self, seqs: Seq[Sequence], ks: Seq[int], rows: list[int], proposals: list[Proposal]
    ) -> bool:
        """Sampled chains for seqs[rows] in one replay of the longest one's sampled chain graph,
        each row's draws taken first from its own generator; False where none serves them (as
        `graph_chains`)."""
        k = max(ks[i] for i in rows)
        graphs = self.sampled_chain_graphs.get(k)
        slots = [seqs[i].draft_slot for i in rows]
        starts = [self.cache.lengths[s] for s in slots]
        if graphs is None or max(starts) + k - 2 >= self.cache.max_seq_len or len(rows) > max(graphs.calls):
            return False
        device = self.next_feature.device
        sampling = RowSampling.of([seqs[i].params for i in rows], device)
        drawn = uniforms([seqs[i].generator for i in rows], k, device)
        where = torch.tensor([starts, slots], dtype=torch.long, device=device).T
        out = graphs.run(where, drawn, sampling.temperature, sampling.top_k, sampling.top_p)
        assert out is not None  # the batch fits a bucket
        tokens, probs = out
        for row, (i, drafts) in enumerate(zip(rows, tokens.tolist())):
            proposals[i].tokens = drafts[: ks[i]]
            # A copy: the graph's outputs are overwritten by its next replay.
            proposals[i].probs = self.model.full_probabilities(probs[row, : ks[i]].clone(), self.draft_ids)
        return True

    def chains(
        self, seqs: Seq[Sequence], ks: Seq[int], active: list[int], proposals: list[Proposal], rule: ConfidenceRule
    ) -> None:
        """Chains for seqs[active] a step at a time, sampled drafts with their probabilities; a
        greedy chain stops at the first draft `rule` does not keep, as the compiled one does."""
        probs: list[list[Tensor]] = [[] for _ in seqs]
        rows = list(active)
        logits = self.next_logits[[seqs[i].draft_slot for i in active]]
        unsure: set[int] = set()  # greedy rows whose chain the rule stopped
        step = 0
        while True:
            tokens = self.draft_ids[logits.argmax(dim=-1)].tolist()
            if rule.floor > 0:
                top = top_probability(logits).tolist()
            for row, i in enumerate(active):
                seq = seqs[i]
                if not seq.params.greedy:
                    q = target_probs(logits[row], seq.params)
                    tokens[row] = int(self.draft_ids[sample(q, seq.generator)])
                    probs[i].append(self.model.full_probabilities(q, self.draft_ids))
                elif rule.floor > 0 and not rule.keeps(top[row]):
                    unsure.add(i)
                    continue
                proposals[i].tokens.append(tokens[row])
            # Sequences that want more drafts, and have room for the chain's next entry.
            going = [
                row
                for row, i in enumerate(active)
                if i not in unsure
                and len(proposals[i].tokens) < ks[i]
                and self.cache.lengths[seqs[i].draft_slot] + step < self.cache.max_seq_len
            ]
            if not going:
                break
            slots = [seqs[active[row]].draft_slot for row in going]
            logits = self.draft(slots, [tokens[row] for row in going], step)
            active = [active[row] for row in going]
            step += 1
        for i, q in enumerate(probs):
            if q:
                proposals[i].probs = torch.stack(q)
        starts = [self.cache.lengths[seqs[i].draft_slot] for i in rows]
        for i, n in zip(rows, self.chain_steps(ks, rows, starts)):
            if i in unsure:
                proposals[i].trimmed = n + 1 - len(proposals[i].tokens)

    def capture(self, k: int, backend: Backend, batch_sizes: Seq[int]) -> int:
        """State k's greedy chain of k drafts and its extend after a verify of k + 1, and the
        chain step every state shares if no state has captured it yet."""
        if k == 0:
            return 0
        memory = 0
        if self.graphs is None:
            self.graphs = self.capture_graphs(backend, batch_sizes)
            memory += self.graphs.memory_bytes
        chain = self.chain_graphs[k] = self.capture_chain(backend, batch_sizes, k)
        extend = self.extend_graphs[k + 1] = self.capture_extend(backend, batch_sizes, k + 1)
        if self.samples_on_device:
            sampled = self.sampled_chain_graphs[k] = self.capture_sampled_chain(backend, batch_sizes, k)
            memory += sampled.memory_bytes
        return memory + chain.memory_bytes + extend.memory_bytes

    @property
    def graph_captures(self) -> int:
        sets = [self.graphs, *self.chain_graphs.values(), *self.sampled_chain_graphs.values()]
        sets += self.extend_graphs.values()
        return sum(graphs.captures for graphs in sets if graphs is not None)

    def release(self, seq: Sequence) -> None:
        if seq.draft_slot is not None:
            self.waiting.pop(seq.draft_slot, None)
            self.cache.release(seq.draft_slot)
            seq.draft_slot = None


class HybridEagle3Drafter(LookupFirst, Eagle3Drafter):
    """Prompt lookup in front of the EAGLE-3 head (`LookupFirst`): a round whose sequences all
    found a continuation in their context runs no head step. The verified positions' features wait
    for the head's next chain whichever proposed, as after rounds at k = 0."""

    name = "hybrid_eagle3"
