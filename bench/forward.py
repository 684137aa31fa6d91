"""One forward of each shape a round uses, the compiled CPU forward against PyTorch operators.

    python -m bench.forward [--model models/target] [--repeats 5]

Decode and verify at batch 1 and 8 after 300 cached tokens, and a 350-token prefill; the two
forwards take turns shape by shape, repeat by repeat, so the machine's drift lands on both. Prints
the median milliseconds of each and their ratio.
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
    compiled = load_checkpoint(args.model).model
    operators = load_checkpoint(args.model, native_forward=False).model
    if compiled.native is None:
        raise SystemExit(f"no compiled forward here: {native.problem()}")
    print(f"{args.model}, {torch.get_num_threads()} threads, median ms of {args.repeats} interleaved repeats")
    print(f"{'forward':<28} {'PyTorch ops':>12} {'compiled':>9} {'ratio':>6}")
    for name, rows, width, start, count in SHAPES:
        ours, theirs = [], []
        for _ in range(args.repeats):
            theirs.append(time_forward(operators, rows, width, start, count))
            ours.append(time_forward(compiled, rows, width, start, count))
        a, b = statistics.median(theirs), statistics.median(ours)
        print(f"{name:<28} {a:>12.3f} {b:>9.3f} {a / b:>5.2f}x")


if __name__ == "__main__":
    main()
