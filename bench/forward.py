"""One forward of each shape a round uses: the compiled CPU forward against PyTorch operators.

    python -m bench.forward [--model models/target] [--repeats 5]

Decode and verify at batch 1 and 8 after 300 cached tokens, and a 350-token prefill, on PyTorch
operators (float32), the compiled forward with float32 weights and with bfloat16 weights (widened
to float32 as they are read: half the bytes to stream, the same float32 arithmetic); the three
take turns shape by shape, repeat by repeat, so the machine's drift lands on all. Prints the
median milliseconds of each and the compiled forwards' speed-ups over PyTorch operators.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import native
from engine.checkpoint import load_checkpoint
from engine.model import ForwardBatch, Transformer

# name, rows, new tokens a row, cached tokens a row, timed forwards
SHAPES = [
    ("decode, batch 1", 1, 1, 300, 100),
    ("verify of 6, batch 1", 1, 6, 300, 50),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/target")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    forwards = {
        "PyTorch ops": load_checkpoint(args.model, native_forward=False).model,
        "compiled": load_checkpoint(args.model).model,
        "compiled bf16": load_checkpoint(args.model, dtype="bfloat16").model,
    }
    if forwards["compiled"].native is None:
        raise SystemExit(f"no compiled forward here: {native.problem()}")
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


if __name__ == "__main__":
    main()
