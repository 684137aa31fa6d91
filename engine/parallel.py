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

import argparse
import dataclasses
import inspect
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engine.model.config import split_problem
from engine.model.kv_cache import KVCache
from engine.model.layers import Linear
from engine.model.transformer import ForwardBatch, Transformer

log = logging.getLogger(__name__)

# How long a collective waits for a rank before failing: a rank that died is noticed within it.
TIMEOUT = timedelta(seconds=10)


class RankLost(RuntimeError):
    """A collective failed: another rank is gone."""


def backend_name(device: torch.device) -> str:
    """The collective library for `device`'s kind."""
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def rank_device(device: str, rank: int) -> str:
    """Where rank `rank` runs when the group runs on `device`: each rank its own accelerator
    (rank r on the r-th after `device`'s index), every rank on the CPU."""
    if device == "cpu":
        return device
    kind, _, index = device.partition(":")
    return f"{kind}:{int(index or 0) + rank}"


def init(rank: int, world: int, address: str, device: torch.device) -> None:
    """Join the group of `world` ranks at `address` ("HOST:PORT", rank 0 listening)."""
    if device.type == "cuda":  # NCCL's collectives run on the current device
        torch.cuda.set_device(device)
    host, port = address.rsplit(":", 1)
    if host == "127.0.0.1" and sys.platform == "linux":  # ranks of one machine: gloo on loopback, not
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # on whatever the host name resolves to
    store = dist.TCPStore(host, int(port), world, rank == 0, timeout=TIMEOUT)
    dist.init_process_group(backend_name(device), store=store, rank=rank, world_size=world, timeout=TIMEOUT)


def close() -> None:
    """Leave the group (before the process exits: a group left open aborts the interpreter's exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class RowParallel(nn.Module):
    """A Linear holding this rank's columns of the input: its output is a partial sum, added up
    over the ranks. A bias is added by rank 0 alone, so that it counts once."""

    def __init__(self, linear: Linear, rank: int, columns: tuple[int, int]) -> None:
        super().__init__()
        _keep(linear, columns=columns)
        if linear.bias is not None and rank:
            linear.bias.data.zero_()
        self.linear = linear

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)
        try:
            dist.all_reduce(y)
        except (RuntimeError, ValueError) as err:
            raise RankLost(lost() or _first_line(err)) from None
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
    problem = split_problem(config, world)
    if problem:
        raise ValueError(problem)
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
        attention.o_proj = RowParallel(attention.o_proj, rank, (rank * h * dim, (rank + 1) * h * dim))
        attention.num_heads, attention.num_kv_heads = h, kv
        attention.q_size, attention.kv_size = h * dim, kv * dim
        _keep(
            mlp.gate_up, rows=[(rank * units, (rank + 1) * units), (inter + rank * units, inter + (rank + 1) * units)]
        )
        mlp.down_proj = RowParallel(mlp.down_proj, rank, (rank * units, (rank + 1) * units))
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


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else repr(err)


def _send(message: object) -> object:
    box = [message]
    try:
        dist.broadcast_object_list(box, src=0)
    except (RuntimeError, ValueError) as err:  # gloo and NCCL say a peer is gone in their own words
        raise RankLost(lost() or _first_line(err)) from None
    return box[0]


class Leader:
    """Rank 0's side: the sharded target, whose every forward is sent to the other ranks first.
    One per model (`Leader.of`); `start` tells the other ranks the cache an engine allocates."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        # What was sent, where someone asked to check that the ranks ran the same (`keep`): a
        # daemon sends a plan every round for as long as it runs.
        self.plans: list[Plan] | None = None
        self.signature = inspect.signature(model.forward)  # how a forward's arguments are named
        model.register_forward_pre_hook(self._before, with_kwargs=True)

    def keep(self) -> None:
        """Keep every plan sent from now on, in `plans`."""
        self.plans = []

    @classmethod
    def of(cls, model: Transformer) -> Leader:
        leader = getattr(model, "_leader", None)
        if leader is None:
            leader = cls(model)
            model._leader = leader  # type: ignore[attr-defined]
        return leader

    def start(self, max_batch_size: int, max_seq_len: int) -> None:
        """The other ranks allocate a cache of this shape (an engine is being built on it)."""
        _send(("start", max_batch_size, max_seq_len))

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        call = self.signature.bind(*args, **kwargs)
        call.apply_defaults()
        batch, cache = call.arguments["batch"], call.arguments["cache"]
        last_only, capture = call.arguments["last_only"], tuple(call.arguments["capture"])
        if not isinstance(batch, ForwardBatch):  # a TokenBatch: rows as the caller gave them
            slots, tokens = list(batch.slots), [list(t) for t in batch.new_tokens]
        else:
            slots = batch.slot_list
            tokens = [row[:n] for row, n in zip(batch.tokens.tolist(), batch.num_new)]
        plan = Plan(slots, [cache.lengths[s] for s in slots], tokens, bool(last_only), capture)
        if self.plans is not None:
            self.plans.append(plan)
        _send(plan)

    def stop(self) -> None:
        _send(("stop",))


def follow(model: Transformer, keep: bool = False) -> list[Plan]:
    """The other ranks' side: run every forward rank 0 sends on this rank's share of `model`,
    until it says stop; returns what was run where asked to `keep` it (else nothing). A lost
    rank raises `RankLost`."""
    cache: KVCache | None = None
    done: list[Plan] = []
    with torch.inference_mode():
        while True:
            message = _send(None)
            if isinstance(message, tuple) and message[0] == "start":
                cache = model.new_cache(message[1], message[2])
                continue
            if not isinstance(message, Plan):
                return done
            assert cache is not None, "a forward before any engine's start"
            for slot, length in zip(message.slots, message.lengths):
                cache.lengths[slot] = length
            model(model.batch(cache, message.slots, message.tokens), cache, message.last_only, message.capture)
            if keep:
                done.append(message)


# Rank 0's view of the ranks it started (`spawn`).
_followers: list[subprocess.Popen] = []


def free_port() -> int:
    """A TCP port of this machine's loopback that nothing listens on (now)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn(world: int, target: str, device: str, dtype: str | None, weights: str) -> str:
    """Start ranks 1 .. world - 1 of a group serving `target` (each a process running this
    module) and return the address rank 0 joins them at."""
    address = f"127.0.0.1:{free_port()}"
    for rank in range(1, world):
        command = [sys.executable, "-m", "engine.parallel", "--rank", str(rank), "--world", str(world)]
        command += ["--address", address, "--target", target, "--device", device, "--weights", weights]
        _followers.append(subprocess.Popen([*command, *(["--dtype", dtype] if dtype else [])]))
    return address


def followers() -> list[int]:
    """The process ids of the ranks this process started, in rank order."""
    return [p.pid for p in _followers]


def lost() -> str | None:
    """Which rank this process started has exited, if one has."""
    for rank, process in enumerate(_followers, start=1):
        if process.poll() is not None:
            return f"rank {rank} exited with status {process.returncode}"
    return None


def shutdown(leader: Leader | None) -> None:
    """Stop the ranks this process started and leave the group (at the end of serving)."""
    try:
        if leader is not None and lost() is None:
            leader.stop()
    except RankLost:
        pass
    close()
    for process in _followers:
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def main(argv: list[str] | None = None) -> int:
    """One rank beyond rank 0: load the target, keep this rank's share, follow rank 0."""
    parser = argparse.ArgumentParser(description="a rank of a tensor-parallel target (started by rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--weights", default="as_loaded")
    args = parser.parse_args(argv)
    from engine.checkpoint import load_checkpoint

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = rank_device(args.device, args.rank)
    try:
        init(args.rank, args.world, args.address, torch.device(device))
        target = load_checkpoint(args.target, device, args.dtype, native_forward=False, weights=args.weights)
        shard(target.model, args.rank, args.world)
        follow(target.model)
    except (RankLost, RuntimeError) as err:  # RuntimeError: the group could not be joined
        log.error("rank %d: lost rank 0 (%s)", args.rank, _first_line(err))
        return 1
    close()
    return 0


if __name__ == "__main__":
    # As engine.parallel, not __main__: the plans rank 0 sends are engine.parallel's classes.
    from engine import parallel

    sys.exit(parallel.main())
