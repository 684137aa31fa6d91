"""One forward of each shape a round uses: the compiled CPU forward against PyTorch operators.

    python -m bench.forward [--model models/target] [--repeats 5]

Decode and verify at batch 1 and 8 after 300 cached tokens, and a 350-token prefill, on PyTorch
operators (float32), the compiled forward with float32 weights and with bfloat16 weights (widened
to float32 as they are read: half the bytes to stream, the same float32 arithmetic); the three
take turns shape by shape, repeat by repeat, so the machine's drift lands on all. Prints the
median milliseconds of each and the compiled forwards' speed-ups over PyTorch operators; then a
DFlash drafter's two calls a round (drafting k = 2 and k = B - 1, each from a block as wide as
the drafter runs it; extending the context) and an EAGLE-3 head's (a chain step, the draft-extend
of a round's kept tokens), each beside the target on PyTorch operators and on the compiled
kernels.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint import load_checkpoint
from engine.drafters.dflash import DFlashDrafter
from engine.drafters.eagle3 import Eagle3Drafter
from engine.model.dflash import load_dflash
from engine.model.eagle3 import load_eagle3
from engine.model.transformer import ForwardBatch, Transformer
from engine.native.build import problem
from engine.request import Request, Sequence

# name, rows, new tokens a row, cached tokens a row, timed forwards
SHAPES = [
    ("decode, batch 1", 1, 1, 300, 100),
    ("verify of 6, batch 1", 1, 6, 300, 50),
    ("verify of 8, batch 1", 1, 8, 300, 50),
    ("decode, batch 4", 4, 1, 300, 50),
    ("verify of 6 a row, batch 4", 4, 6, 300, 20),
    ("decode, batch 8", 8, 1, 300, 50),
    ("verify of 4 a row, batch 8", 8, 4, 300, 20),
    ("prefill of 350", 1, 350, 0, 3),
]


@torch.inference_mode()
def time_forward(model: Transformer, rows: int, width: int, start: int, count: int) -> float:
    cache = model.new_cache(rows, start + width)
    slots = [cache.allocate() for _ in range(rows)]
    tokens = [[(7 * i + 3 * j) % model.config.vocab_size for j in range(width)] for i in range(rows)]
    if start:  # a real context to attend to
        context = [[(5 * p) % 97 + 1 for p in range(start)]] * rows
        model(ForwardBatch.build(cache, slots, context, model.config.sliding_window), cache)
    elapsed = []
    for _ in range(count + 1):
        for slot in slots:
            cache.truncate(slot, start)
        began = time.perf_counter()
        model(ForwardBatch.build(cache, slots, tokens, model.config.sliding_window), cache)
        elapsed.append(time.perf_counter() - began)
    return statistics.median(elapsed[1:]) * 1e3


@torch.inference_mode()
def time_dflash(
    drafter: DFlashDrafter, served: Transformer, rows: int, kept: int, count: int, k: int
) -> tuple[float, float]:
    """Median ms of a DFlash drafter's two calls a round after 300 context tokens a row: drafting
    k from every row's block (as wide as the drafter runs it for k) and extending every row's
    context by `kept` tokens."""
    cache = served.new_cache(rows, 400)
    slots = [cache.allocate() for _ in range(rows)]
    context = [[(5 * p) % 97 + 1 for p in range(301)]] * rows
    taps = served(served.batch(cache, slots, context), cache, capture=drafter.capture_layers).hidden
    seqs = [Sequence(Request(tuple(c)), slot=s, generator=None, tokens=list(c)) for s, c in zip(slots, context)]
    drafter.admit(seqs, taps)
    block = torch.full((rows, drafter.block_width(k)), drafter.config.mask_token_id)
    drafting, extending = [], []
    for _ in range(count + 1):
        began = time.perf_counter()
        drafter.block_logits([s.draft_slot for s in seqs], block, k)
        drafting.append(time.perf_counter() - began)
        began = time.perf_counter()
        drafter.accept(seqs, [kept - 1] * rows, taps)
        extending.append(time.perf_counter() - began)
        for seq in seqs:
            drafter.cache.truncate(seq.draft_slot, 300)
    for seq in seqs:
        drafter.release(seq)
    return statistics.median(drafting[1:]) * 1e3, statistics.median(extending[1:]) * 1e3


@torch.inference_mode()
def time_eagle3(drafter: Eagle3Drafter, served: Transformer, rows: int, kept: int, count: int) -> tuple[float, float]:
    """Median ms of an EAGLE-3 head's calls a round after 300 context tokens a row: one chain step
    of every row, and the draft-extend of `kept` tokens a row."""
    cache = served.new_cache(rows, 400)
    slots = [cache.allocate() for _ in range(rows)]
    context = [[(5 * p) % 97 + 1 for p in range(301)]] * rows
    taps = served(served.batch(cache, slots, context), cache, capture=drafter.capture_layers).hidden
    seqs = [Sequence(Request(tuple(c)), slot=s, generator=None, tokens=list(c)) for s, c in zip(slots, context)]
    drafter.admit(seqs, taps)
    drafter.catch_up(seqs)
    stepping, extending = [], []
    for _ in range(count + 1):
        for seq in seqs:
            drafter.cache.truncate(seq.draft_slot, 300 - kept)
        began = time.perf_counter()
        drafter.accept(seqs, [kept - 1] * rows, taps)
        drafter.catch_up(seqs)
        extending.append(time.perf_counter() - began)
        began = time.perf_counter()
        drafter.draft([s.draft_slot for s in seqs], [3] * rows, 0)
        stepping.append(time.perf_counter() - began)
    for seq in seqs:
        drafter.release(seq)
    return statistics.median(stepping[1:]) * 1e3, statistics.median(extending[1:]) * 1e3


def time_calls(
    drafters: dict[str, Any],
    forwards: dict[str, Transformer],
    timer: Callable[[Any, Transformer, int, int, int], tuple[float, float]],
    names: tuple[str, str],
    repeats: int,
) -> None:
    """Print a drafter's two calls a round (`timer` gives their median ms), at batch 1 and 4 with
    4 kept tokens a row: the median over `repeats` beside each target (the drafters take turns),
    and the compiled one's speed-up."""
    kept = 4
    for rows in (1, 4):
        times: tuple[dict[str, list[float]], ...] = ({f: [] for f in drafters}, {f: [] for f in drafters})
        for _ in range(repeats):
            for forward, drafter in drafters.items():
                for call, ms in zip(times, timer(drafter, forwards[forward], rows, kept, 50)):
                    call[forward].append(ms)
        for what, call in zip((f"{names[0]}, batch {rows}", f"{names[1]} +{kept}, batch {rows}"), times):
            medians = [statistics.median(t) for t in call.values()]
            print(
                f"{what:<28} " + " ".join(f"{m:>14.3f}" for m in medians) + f" {'':>14} {medians[0] / medians[1]:.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/target")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dflash", default="models/dflash", help="a DFlash drafter for the model, timed where it exists"
    )
    parser.add_argument(
        "--eagle3", default="models/eagle3", help="an EAGLE-3 head for the model, timed where it exists"
    )
    args = parser.parse_args()
    forwards = {
        "PyTorch ops": load_checkpoint(args.model, native_forward=False).model,
        "compiled": load_checkpoint(args.model).model,
        "compiled bf16": load_checkpoint(args.model, dtype="bfloat16").model,
    }
    if forwards["compiled"].native is None:
        raise SystemExit(f"no compiled forward here: {problem()}")
    print(f"{args.model}, {torch.get_num_threads()} threads, median ms of {args.repeats} interleaved repeats")
    print(f"{'forward':<28} " + " ".join(f"{name:>14}" for name in forwards) + f" {'speed-ups':>14}")
    for name, rows, width, start, count in SHAPES:
        times: dict[str, list[float]] = {forward: [] for forward in forwards}
        for _ in range(args.repeats):
            for forward, model in forwards.items():
                times[forward].append(time_forward(model, rows, width, start, count))
        medians = [statistics.median(t) for t in times.values()]
        ratios = " / ".join(f"{medians[0] / m:.2f}x" for m in medians[1:])
        print(f"{name:<28} " + " ".join(f"{m:>14.3f}" for m in medians) + f" {ratios:>14}")
    pair = list(forwards.items())[:2]  # each drafter beside the target on PyTorch operators, and on the kernels
    if (Path(args.dflash) / "config.json").exists():
        drafters = {forward: DFlashDrafter(load_dflash(args.dflash, model), model, 4, 512) for forward, model in pair}
        drafter = next(iter(drafters.values()))
        print(f"{args.dflash}: a block of {drafter.config.block_size}, 300 context tokens a row")
        for k in sorted({2, drafter.max_k}):
            width = drafter.block_width(k)
            timer = functools.partial(time_dflash, k=k)
            time_calls(drafters, forwards, timer, (f"dflash draft k={k} ({width})", "dflash context"), args.repeats)
    if (Path(args.eagle3) / "config.json").exists():
        heads = {forward: Eagle3Drafter(load_eagle3(args.eagle3, model), model, 4, 512) for forward, model in pair}
        print(f"{args.eagle3}: 300 context tokens a row")
        time_calls(heads, forwards, time_eagle3, ("eagle3 chain step", "eagle3 extend"), args.repeats)


if __name__ == "__main__":
    main()
