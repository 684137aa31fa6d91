"""A draft model: a smaller model with the target's tokenizer, drafting a step at a time."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence as Seq

import torch
from torch import Tensor, nn

from engine.checkpoint import Checkpoint
from engine.confidence import EVERY_DRAFT, ConfidenceRule
from engine.device.backend import Backend
from engine.device.graphs import ForwardMode, GraphRunner, GraphSet
from engine.drafters.base import Drafter, Proposal
from engine.drafters.ngram import LookupFirst
from engine.model.kv_cache import KVCache
from engine.model.transformer import Transformer
from engine.native.forward import NativeForward
from engine.request import Sequence
from engine.sampling import draw_rows, sample, target_probs


class Int8Linear(nn.Module):
    """A linear layer with int8 weights whose input is quantized on the fly (fbgemm's dynamic int8
    kernel, per-tensor weights as torch.ao's default dynamic qconfig makes them), calling the
    kernel directly: torch.ao's module spends about 3.5 us of Python around a 10.6 us call (256 to
    512 features, one row), and a draft step of the default draft model makes nine such calls."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        plain = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        plain.load_state_dict(linear.state_dict())
        plain.qconfig = torch.ao.quantization.default_dynamic_qconfig
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization points to torchao; it still works
            quantized = torch.ao.nn.quantized.dynamic.Linear.from_float(plain)
        self.packed_params = quantized._packed_params._packed_params

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic.default(x, self.packed_params, True)


def int8_linears(model: Transformer) -> Transformer:
    """`model` with its linear layers' weights in int8: on the compiled CPU kernels, a view of it
    whose forward reads int8 copies (widened as they are read); else a copy whose linear layers run
    with PyTorch's dynamic int8 quantization."""
    if model.native is not None:
        view = copy.copy(model)  # the parameters are shared; only the forward's copies differ
        view.native = NativeForward(model, model.native.lib, linears=torch.int8)
        return view
    quantized = Transformer(model.config, model.max_positions)
    quantized.load_state_dict(model.state_dict())
    quantized.eval().requires_grad_(False)
    for parent in list(quantized.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
    return quantized


class DraftModelDrafter(Drafter):
    """A smaller model with the target's tokenizer and its own KV cache.

    Its cache holds a prefix of `seq.tokens`; whatever it lacks (the target's last token, and the
    last draft when every draft was accepted) is fed at the start of the next proposal.
    """

    name = "draft_model"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, draft: Checkpoint, max_batch_size: int, max_seq_len: int, quantize: bool = False) -> None:
        self.checkpoint = draft
        # On CPU a draft step streams the draft's weights from memory (the target's evict them
        # from cache every round): int8 weights are half the bytes of bfloat16. The draft's
        # precision only moves the acceptance rate; the target verifies every token.
        self.model = int8_linears(draft.model) if quantize and draft.device.type == "cpu" else draft.model
        self.cache: KVCache = self.model.new_cache(max_batch_size, max_seq_len)
        # Decode-step graphs, shared by every runtime state, captured with the first state that drafts.
        self.graph_runner: GraphRunner | None = None
        self.graphs: GraphSet | None = None

    def admit(self, seqs: Seq[Sequence], hidden: dict[int, Tensor] | None = None) -> None:
        # The prompt is fed at the first proposal, with whatever else the cache lacks: a request
        # served at k = 0 throughout never runs the draft model.
        for seq in seqs:
            seq.draft_slot = self.cache.allocate()

    def _forward(
        self, seqs: Seq[Sequence], inputs: Seq[Seq[int]], mode: ForwardMode = ForwardMode.PREFILL
    ) -> Tensor | None:
        rows = [(seq, tokens) for seq, tokens in zip(seqs, inputs) if tokens]
        if not rows:
            return None
        slots = [seq.draft_slot for seq, _ in rows]
        tokens = [t for _, t in rows]
        out = self.graphs.run(mode, slots, tokens) if self.graphs is not None else None
        if out is None:
            batch = self.model.batch(self.cache, slots, tokens)
            out = self.model(batch, self.cache, last_only=True)
        return out.logits[:, -1]

    def propose(self, seqs: Seq[Sequence], ks: Seq[int], rule: ConfidenceRule = EVERY_DRAFT) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        probs: list[list[Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        inputs = {i: seqs[i].tokens[self.cache.lengths[seqs[i].draft_slot] :] for i in active}
        native = self.model.native if self.graphs is None else None
        if native is not None:
            # Greedy chains run whole in the kernels: a forward from Python costs a third again of its arithmetic.
            greedy = [i for i in active if seqs[i].params.greedy]
            if greedy:
                slots, fed = [seqs[i].draft_slot for i in greedy], [inputs[i] for i in greedy]
                for i, tokens in zip(greedy, native.greedy_chain(self.cache, slots, fed, [ks[i] for i in greedy])):
                    proposals[i].tokens = tokens
            active = [i for i in active if not seqs[i].params.greedy]
        while active:
            logits = self._forward([seqs[i] for i in active], [inputs[i] for i in active], ForwardMode.DRAFT)
            chosen, drawn = logits.argmax(dim=-1), {}
            sampled = [row for row, i in enumerate(active) if not seqs[i].params.greedy]
            if sampled and self.samples_on_device:
                # The step's sampled rows drawn together on the device: one read back a step, not a row.
                rows = [seqs[active[row]] for row in sampled]
                tokens, q = draw_rows(logits[sampled], [s.params for s in rows], [s.generator for s in rows])
                chosen = chosen.index_copy(0, torch.tensor(sampled, device=logits.device), tokens)
                drawn = dict(zip(sampled, q))
            picked = chosen.tolist()
            for row, i in enumerate(active):
                seq, token = seqs[i], picked[row]
                if row in drawn:
                    probs[i].append(drawn[row])
                elif not seq.params.greedy:
                    q = target_probs(logits[row], seq.params)
                    token = sample(q, seq.generator)
                    probs[i].append(q)
                proposals[i].tokens.append(token)
                inputs[i] = [token]
            active = [i for i in active if len(proposals[i].tokens) < ks[i]]
        for i, q in enumerate(probs):
            if q:
                proposals[i].probs = torch.stack(q)
        return proposals

    def accept(self, seqs: Seq[Sequence], accepted: Seq[int], hidden: dict[int, Tensor]) -> None:
        for seq in seqs:
            # Everything in the draft cache up to the target's newest token is now confirmed.
            keep = min(self.cache.lengths[seq.draft_slot], len(seq.tokens) - 1)
            self.cache.truncate(seq.draft_slot, keep)

    def release(self, seq: Sequence) -> None:
        if seq.draft_slot is not None:
            self.cache.release(seq.draft_slot)
            seq.draft_slot = None

    def capture(self, k: int, backend: Backend, batch_sizes: Seq[int]) -> int:
        """The decode steps, widths 1 and 2 (2 when every draft of the last round was kept), which
        no k changes: captured with the first state that drafts, which pays for them."""
        if k == 0 or self.graphs is not None:
            return 0
        self.graph_runner = GraphRunner(self.model, self.cache, backend, batch_sizes)
        self.graphs = self.graph_runner.capture(ForwardMode.DRAFT, [1, 2])
        return self.graphs.memory_bytes

    @property
    def graph_captures(self) -> int:
        return self.graph_runner.captures if self.graph_runner is not None else 0


class HybridDrafter(LookupFirst, DraftModelDrafter):
    """Prompt lookup in front of the draft model (`LookupFirst`). Text that repeats itself
    (boilerplate, code restating its own names) gets long chains for the price of verifying them:
    a lookup takes about 2 us, a draft step of the default int8 draft about 0.47 ms. The draft
    model's cache catches up on what the lookups proposed at its next step."""

    name = "hybrid"
