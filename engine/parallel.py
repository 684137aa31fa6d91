"""One target across ranks: tensor parallelism on torch.distributed.

Each rank keeps a share of every layer (`shard`): its heads of q, k and v with their rows of
o_proj's input, and its share of the MLP's units with their rows of down_proj's input; o_proj and
down_proj then hold partial sums, added up over the ranks by one all-reduce each (`RowParallel`).
Embeddings, norms and the LM head are whole on every rank, so every rank ends a forward with the
same hidden states and logits.

Rank 0 runs everything else as on one device: the engine, the drafter, the policy. Every target
forward it runs is first sent to the other ranks (`Leader`): each row's cache slot, its cached
length and its new tokens, which is the round's plan as the target sees it (a verify of k + 1
tokens a row is a round at k). The other ranks (`follow`) run the same forward on their share,
joining its all-reduces, until rank 0 says stop. A rank that dies ends the others: the next
collective fails on every rank, and `follow` (and `Leader`'s caller) says which rank was lost.

The group is gloo on a CPU (testable with two processes on one machine), NCCL on CUDA and HCCL on
Ascend NPUs (`backend_name`). The compiled CPU forward serves one process; a sharded model runs on
PyTorch's operators.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engine.model.kv_cache import KVCache
from engine.model.layers import Linear
from engine.model.transformer import ForwardBatch, ForwardOutput, Transformer

log = logging.getLogger(__name__)

# How long a collective waits for a rank before failing: a rank that died is noticed within it.
TIMEOUT = timedelta(seconds=10)


class RankLost(RuntimeError):
    """A collective failed: another rank is gone."""


def backend_name(device: torch.device) -> str:
    """The collective library for `device`'s kind."""
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def init(rank: int, world: int, address: str, device: torch.device) -> None:
    """Join the group of `world` ranks at `address` ("HOST:PORT", rank 0 listening)."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world, rank == 0, timeout=TIMEOUT)
    dist.init_process_group(backend_name(device), store=store, rank=rank, world_size=world, timeout=TIMEOUT)


def close() -> None:
    """Leave the group (before the process exits: a group left open aborts the interpreter's exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class RowParallel(nn.Module):
    """A Linear holding this rank's columns of the input: its output is a partial sum, added up
    over the ranks. A bias is added by rank 0 alone, so that it counts once."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)
        dist.all_reduce(y)
        return y


def _rows(weight: Tensor, parts: Sequence[tuple[int, int]]) -> Tensor:
    """The rows [start, end) of each part, stacked."""
    return torch.cat([weight[start:end] for start, end in parts])


def _keep(
    linear: Linear, rows: Sequence[tuple[int, int]] | None = None, columns: tuple[int, int] | None = None
) -> None:
    """Cut `linear` to the given output rows and/or input columns."""
    weight, bias = linear.weight.data, linear.bias.data if linear.bias is not None else None
    if rows is not None:
        weight = _rows(weight, rows)
        bias = _rows(bias, rows) if bias is not None else None
    if columns is not None:
        weight = weight[:, columns[0] : columns[1]]
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    linear.in_features, linear.out_features = weight.shape[1], weight.shape[0]
    if linear.packed is not None:  # oneDNN's copy of the whole weight: packed again from this share
        linear.pack()


def shard(model: Transformer, rank: int, world: int) -> None:
    """Keep rank `rank`'s share of `model`'s layers (in place), as the module docstring says."""
    config = model.config
    heads, kv_heads, dim, inter = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    if heads % world or kv_heads % world or inter % world:
        raise ValueError(f"{world} ranks cannot share {heads} heads, {kv_heads} KV heads and {inter} MLP units evenly")
    if model.native is not None:
        raise ValueError("a sharded model runs on PyTorch's operators: load it with native_forward=False")
    h, kv, units = heads // world, kv_heads // world, inter // world
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        q0, k0, v0 = 0, heads * dim, (heads + kv_heads) * dim
        _keep(
            attention.qkv,
            rows=[
                (q0 + rank * h * dim, q0 + (rank + 1) * h * dim),
                (k0 + rank * kv * dim, k0 + (rank + 1) * kv * dim),
                (v0 + rank * kv * dim, v0 + (rank + 1) * kv * dim),
            ],
        )
        _keep(attention.o_proj, columns=(rank * h * dim, (rank + 1) * h * dim))
        if attention.o_proj.bias is not None and rank:
            attention.o_proj.bias.data.zero_()
        attention.o_proj = RowParallel(attention.o_proj)
        attention.num_heads, attention.num_kv_heads = h, kv
        attention.q_size, attention.kv_size = h * dim, kv * dim
        _keep(
            mlp.gate_up, rows=[(rank * units, (rank + 1) * units), (inter + rank * units, inter + (rank + 1) * units)]
        )
        _keep(mlp.down_proj, columns=(rank * units, (rank + 1) * units))
        if mlp.down_proj.bias is not None and rank:
            mlp.down_proj.bias.data.zero_()
        mlp.down_proj = RowParallel(mlp.down_proj)
    # The cache holds this rank's KV heads; the config says what one rank runs.
    model.config = dataclasses.replace(config, num_heads=h, num_kv_heads=kv, intermediate_size=units)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One target forward as rank 0 runs it: each row's slot, cached length and new tokens."""

    slots: list[int]
    lengths: list[int]
    tokens: list[list[int]]
    last_only: bool
    capture: tuple[int, ...]

    @property
    def k(self) -> int:
        """The draft length of the round this forward verifies (the longest row's, less one)."""
        return max(len(t) for t in self.tokens) - 1


def _send(message: object) -> object:
    box = [message]
    try:
        dist.broadcast_object_list(box, src=0)
    except (RuntimeError, ValueError) as err:  # gloo and NCCL say a peer is gone in their own words
        raise RankLost(str(err).splitlines()[0] if str(err) else repr(err)) from None
    return box[0]


class Leader:
    """Rank 0's side: the sharded target, whose every forward is sent to the other ranks first.
    Used in place of the model (`Engine(..., model=...)` takes it through the checkpoint)."""

    def __init__(self, model: Transformer, max_batch_size: int, max_seq_len: int) -> None:
        self.model = model
        self.plans: list[Plan] = []  # what was sent, for whoever checks the ranks ran the same
        _send(("start", max_batch_size, max_seq_len))
        model.register_forward_pre_hook(self._before, with_kwargs=True)

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        batch, cache = (list(args) + [kwargs.get("batch"), kwargs.get("cache")])[:2]
        last_only = kwargs.get("last_only", args[2] if len(args) > 2 else False)
        capture = tuple(kwargs.get("capture", args[3] if len(args) > 3 else ()))
        if not isinstance(batch, ForwardBatch):  # a TokenBatch: rows as the caller gave them
            slots, tokens = list(batch.slots), [list(t) for t in batch.new_tokens]
        else:
            slots = batch.slot_list
            tokens = [row[:n] for row, n in zip(batch.tokens.tolist(), batch.num_new)]
        plan = Plan(slots, [cache.lengths[s] for s in slots], tokens, bool(last_only), capture)
        self.plans.append(plan)
        _send(plan)

    def stop(self) -> None:
        _send(("stop",))


def follow(model: Transformer) -> list[Plan]:
    """The other ranks' side: run every forward rank 0 sends on this rank's share of `model`,
    until it says stop; returns what was run. A lost rank raises `RankLost`."""
    start = _send(None)
    assert isinstance(start, tuple) and start[0] == "start", start
    cache: KVCache = model.new_cache(start[1], start[2])
    done: list[Plan] = []
    with torch.inference_mode():
        while True:
            plan = _send(None)
            if not isinstance(plan, Plan):
                return done
            for slot, length in zip(plan.slots, plan.lengths):
                cache.lengths[slot] = length
            out: ForwardOutput = model(model.batch(cache, plan.slots, plan.tokens), cache, plan.last_only, plan.capture)
            del out
            done.append(plan)
