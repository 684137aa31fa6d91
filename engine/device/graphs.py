"""Captured forwards: static-shape versions of the target's verify and the draft model's decode steps.

A graph replays fixed kernels on fixed memory, while `Transformer.forward` is shaped by its batch
(attention reads up to the longest sequence, last-token picks are built from host lists). So a
captured forward reads one static int64 input per (mode, width, batch size):

    inputs[b] = [tokens (width, right-padded) | start | new-token count | cache slot]

and derives everything else on the device: positions, write positions (padding goes to the cache's
scratch position), and a mask over the whole cache row (max_seq_len + 1 keys, scratch included and
never visible), so the key length never changes. Rows past the real batch have no new tokens: they
read slot 0 and write only its scratch position. Host-side cache lengths are updated outside the
graph, exactly as the eager forward does.

What is captured, and who owns it:
- VERIFY: the target's forward of width k+1 with the drafter's hidden-state layers, one graph per
  batch-size bucket, owned by the RuntimeState of that k (built with it, never on a switch).
- DRAFT: the draft model's decode step, widths 1 and 2 (2 when the previous round accepted every
  draft and both the last draft and the target's token are fed), one graph per bucket, last token
  only. It does not depend on k, so one set is shared by every state: it is captured with the first
  state that drafts (which pays its time and memory) and lives on the drafter.
- PREFILL is not captured whole here: prompts' lengths never repeat. engine/device/prefill.py
  captures the work between attentions per token bucket instead, with attention eager.
- A feature drafter's own forward (an EAGLE-3 chain step, a DFlash block) is not a Transformer
  forward: `CallGraphs` captures any such function of static inputs, one graph per bucket, shared
  by every state like the draft model's steps. An EAGLE-3 head's greedy chain of k drafts is
  also captured whole, owned by state k: one replay a round, the argmax of each step feeding the
  next on the device. Each feature drafter's extend after a verify of k + 1 tokens is owned by
  state k too (positions past a sequence's kept ones write its scratch position); an EAGLE-3
  head's extend of anything else held (a prompt, rounds at k = 0 since) runs eagerly. Each
  drafter captures its own (`Drafter.capture`).

Guards: a graph is only replayed for a batch of the same mode and the same hidden-capture layers,
whose widest row and batch size fit (padded) the graph's; anything else runs eagerly. A verify of
width 1 (k = 0) therefore never replays a draft step or a prefill. Outputs (logits, hidden states)
are views of the graph's static buffers: read them before the next replay.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.device.backend import Backend, Graph
from engine.model.kv_cache import KVCache
from engine.model.transformer import ForwardBatch, ForwardOutput, Transformer, visible_keys


class ForwardMode(enum.Enum):
    PREFILL = "prefill"  # prompts: any number of tokens per sequence
    DRAFT = "draft"  # a draft model's decode step: last-token logits only
    VERIFY = "verify"  # the target's k+1 tokens: logits at every position


@dataclass(frozen=True)
class GraphKey:
    mode: ForwardMode
    width: int  # new tokens per row
    batch_size: int  # rows, padded
    capture: tuple[int, ...] = ()  # layers whose hidden states are outputs


def select_graph(
    keys: Iterable[GraphKey], mode: ForwardMode, width: int, batch_size: int, capture: Seq[int] = ()
) -> GraphKey | None:
    """The smallest captured graph a batch fits, or None to run eagerly.

    Mode and hidden-capture layers must match exactly (a graph captured for another mode computes
    other outputs; one captured without a layer cannot return its hidden state); width and batch
    size may be padded up to the graph's.
    """
    capture = tuple(capture)
    fits = [
        key
        for key in keys
        if key.mode is mode and key.capture == capture and key.width >= width and key.batch_size >= batch_size
    ]
    return min(fits, key=lambda key: (key.width, key.batch_size), default=None)


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to max_batch_size, which is always one of them."""
    sizes = []
    size = 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]


def pack_inputs(
    cache: KVCache, slots: Seq[int], new_tokens: Seq[Seq[int]], width: int, batch_size: int
) -> Tensor | None:
    """The static input rows of a batch, padded to [batch_size, width + 3] on the host; None when
    a row has no tokens or would overflow its cache (the eager path then raises the error)."""
    flat: list[int] = []
    for slot, tokens in zip(slots, new_tokens):
        n, start = len(tokens), cache.lengths[slot]
        if not 0 < n <= width or start + n > cache.max_seq_len:
            return None
        flat.extend(tokens)
        flat.extend([0] * (width - n))
        flat += [start, n, slot]
    flat.extend([0] * ((batch_size - len(slots)) * (width + 3)))
    return torch.tensor(flat, dtype=torch.long).view(batch_size, width + 3)


def copy_in(buffer: Tensor, value: Tensor) -> None:
    """Copy `value` into a graph's input buffer without waiting for the device. On an NPU a host
    tensor goes through pinned memory first: torch_npu queues an asynchronous copy with the raw
    host pointer, which may be read after the tensor is freed, while a pinned block is held until
    the copy has run. CUDA copies ordinary host memory to its own staging before returning."""
    if buffer.device.type == "npu" and value.device.type == "cpu" and not value.is_pinned():
        value = value.contiguous().pin_memory()
    buffer.copy_(value, non_blocking=True)


def static_batch(inputs: Tensor, width: int, max_seq_len: int, sliding_window: int | None) -> ForwardBatch:
    """The ForwardBatch a static input stands for, built with device ops only (capturable)."""
    tokens = inputs[:, :width]
    start = inputs[:, width : width + 1]
    num_new = inputs[:, width + 1 : width + 2]
    key_pos = torch.arange(max_seq_len + 1, device=inputs.device)
    offsets = key_pos[None, :width]
    positions = (start + offsets).clamp(max=max_seq_len - 1)
    write_pos = torch.where(offsets < num_new, positions, max_seq_len)
    visible = visible_keys(positions[:, :, None], key_pos[None, None, :], sliding_window)
    return ForwardBatch(
        tokens=tokens,
        positions=positions,
        write_pos=write_pos,
        slots=inputs[:, width + 2],
        slot_start=None,
        num_new=[],  # host lengths are the runner's job
        kv_len=max_seq_len + 1,
        mask=visible[:, None],
    )


def static_forward(
    model: Transformer, cache: KVCache, inputs: Tensor, width: int, capture: tuple[int, ...], last_only: bool
) -> tuple[Tensor, ...]:
    """The body a graph captures: (logits, *hidden states in `capture` order)."""
    batch = static_batch(inputs, width, cache.max_seq_len, model.config.sliding_window)
    x, hidden = model.run_layers(batch, cache, capture)
    if last_only:
        last = (inputs[:, width + 1 : width + 2] - 1).clamp(min=0)
        x = x.gather(1, last[:, :, None].expand(-1, -1, x.shape[-1]))
    return (model.lm_head(model.norm(x)), *(hidden[i] for i in capture))


@dataclass
class CapturedForward:
    key: GraphKey
    graph: Graph
    inputs: Tensor  # [batch_size, width + 3] int64, see pack_inputs
    logits: Tensor  # [batch_size, width, V], or [batch_size, 1, V] for DRAFT
    hidden: dict[int, Tensor]


@dataclass
class GraphSet:
    """Graphs captured together (one state's verify, or the shared draft steps) and their cost."""

    runner: GraphRunner
    graphs: dict[GraphKey, CapturedForward] = field(default_factory=dict)
    seconds: float = 0.0
    memory_bytes: int = 0

    def run(
        self, mode: ForwardMode, slots: Seq[int], new_tokens: Seq[Seq[int]], capture: Seq[int] = ()
    ) -> ForwardOutput | None:
        return self.runner.replay(self.graphs, mode, slots, new_tokens, capture)


class GraphRunner:
    """Captures and replays the forwards of one model over one cache, through a backend."""

    def __init__(self, model: Transformer, cache: KVCache, backend: Backend, batch_sizes: Iterable[int]) -> None:
        if model.native is not None:
            raise ValueError("graphs capture the PyTorch forward; this model runs the compiled CPU one")
        self.model = model
        self.cache = cache
        self.backend = backend
        self.batch_sizes = sorted({b for b in batch_sizes if b >= 1})
        if not self.batch_sizes:
            raise ValueError("graphs need at least one batch size")
        self.captures = 0  # every graph ever captured: switching state must never add to it
        self.replays = 0
        self.eager_runs = 0  # run() calls no graph fitted

    def capture(self, mode: ForwardMode, widths: Iterable[int], capture: Seq[int] = ()) -> GraphSet:
        """Capture `mode` at each width for every batch size; records the time and memory it took."""
        if mode is ForwardMode.PREFILL:
            raise ValueError("prompts are captured piecewise (engine/device/prefill.py), not as whole forwards")
        self.backend.empty_cache()  # so that the reserved-memory delta is what the graphs hold
        before = self.backend.memory_reserved()
        started = time.perf_counter()
        graphs = {}
        with torch.inference_mode():
            for width in widths:
                # Largest first: smaller batches then reuse its blocks in the shared pool.
                for batch_size in reversed(self.batch_sizes):
                    key = GraphKey(mode, width, batch_size, tuple(capture))
                    graphs[key] = self._capture(key)
        self.backend.synchronize()
        seconds = time.perf_counter() - started
        return GraphSet(self, graphs, seconds, max(0, self.backend.memory_reserved() - before))

    def _capture(self, key: GraphKey) -> CapturedForward:
        # All-padding input: warm-up runs only write the scratch position of slot 0, never read.
        inputs = torch.zeros(key.batch_size, key.width + 3, dtype=torch.long, device=self.cache.k.device)
        last_only = key.mode is ForwardMode.DRAFT

        def body() -> tuple[Tensor, ...]:
            return static_forward(self.model, self.cache, inputs, key.width, key.capture, last_only)

        graph, (logits, *hidden) = self.backend.capture(body)
        self.captures += 1
        return CapturedForward(key, graph, inputs, logits, dict(zip(key.capture, hidden)))

    def replay(
        self,
        graphs: Mapping[GraphKey, CapturedForward],
        mode: ForwardMode,
        slots: Seq[int],
        new_tokens: Seq[Seq[int]],
        capture: Seq[int] = (),
    ) -> ForwardOutput | None:
        """Run the batch through the graph it fits and update the cache lengths; None when no graph
        fits (the caller runs eagerly)."""
        width = max((len(t) for t in new_tokens), default=0)
        key = select_graph(graphs, mode, width, len(slots), capture)
        packed = None if key is None else pack_inputs(self.cache, slots, new_tokens, key.width, key.batch_size)
        if key is None or packed is None:
            self.eager_runs += 1
            return None
        captured = graphs[key]
        with torch.inference_mode():
            copy_in(captured.inputs, packed)
            captured.graph.replay()
        for slot, tokens in zip(slots, new_tokens):
            self.cache.lengths[slot] += len(tokens)
        self.replays += 1
        rows = len(slots)
        return ForwardOutput(logits=captured.logits[:rows], hidden={i: h[:rows] for i, h in captured.hidden.items()})


@dataclass
class CapturedCall:
    graph: Graph
    padding: tuple[Tensor, ...]  # what rows past the real batch hold: they may only write scratch
    inputs: tuple[Tensor, ...]  # the static inputs, [batch_size, ...] each
    outputs: tuple[Tensor, ...]


class CallGraphs:
    """`body(*inputs)` captured once per batch-size bucket, where `padding(batch_size)` makes the
    inputs a graph is captured with and the rows a replay pads the batch with.

    A replay copies the batch's rows into the static inputs and resets every row past them to
    padding, so that a row left by a larger earlier batch never writes into a live sequence.
    """

    def __init__(
        self,
        backend: Backend,
        batch_sizes: Iterable[int],
        padding: Callable[[int], tuple[Tensor, ...]],
        body: Callable[..., tuple[Tensor, ...]],
    ) -> None:
        self.calls: dict[int, CapturedCall] = {}
        self.captures = 0
        self.replays = 0
        self.eager_runs = 0  # run() calls no graph fitted
        backend.empty_cache()
        before = backend.memory_reserved()
        started = time.perf_counter()
        with torch.inference_mode():
            for batch_size in sorted(set(batch_sizes), reverse=True):  # largest first, as GraphRunner
                pad = padding(batch_size)
                inputs = tuple(t.clone() for t in pad)
                graph, outputs = backend.capture(lambda inputs=inputs: body(*inputs))
                self.calls[batch_size] = CapturedCall(graph, pad, inputs, tuple(outputs))
                self.captures += 1
        backend.synchronize()
        self.seconds = time.perf_counter() - started
        self.memory_bytes = max(0, backend.memory_reserved() - before)

    def run(self, *values: Tensor) -> tuple[Tensor, ...] | None:
        """The outputs' first rows for a batch of `values` (one per input, rows first), or None
        when the batch is larger than every bucket (the caller runs eagerly). The outputs are
        views of the graph's buffers: read them before the next replay."""
        rows = values[0].shape[0]
        size = min((b for b in self.calls if b >= rows), default=None)
        if size is None:
            self.eager_runs += 1
            return None
        call = self.calls[size]
        with torch.inference_mode():
            for buffer, value, pad in zip(call.inputs, values, call.padding):
                copy_in(buffer[:rows], value)
                buffer[rows:].copy_(pad[rows:])
            call.graph.replay()
        self.replays += 1
        return tuple(out[:rows] for out in call.outputs)
