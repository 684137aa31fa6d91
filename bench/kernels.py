"""The checkout's compiled CPU kernels against another kernels.c, taking turns in one process.

    git show HEAD~1:engine/native/kernels.c > /tmp/before.c
    python -m bench.kernels /tmp/before.c [--model models/target] [--dtype bfloat16] [--repeats 7]

Two copies of the model, one forward through each build, on `bench.forward`'s shapes, shape by
shape and repeat by repeat, so the machine's drift lands on both; prints the median ms of each and
the checkout's speed-up (another build loads beside the checkout's: only their sources differ).
Also says whether the two builds give the same logits bit for bit, which a change of speed alone
should keep.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
from pathlib import Path

import torch

from bench.forward import SHAPES, time_forward
from engine.checkpoint import load_checkpoint
from engine.model.transformer import Transformer
from engine.native.build import _build, _load, library, problem
from engine.native.forward import NativeForward


def build(source: Path) -> ctypes.CDLL:
    """The kernels compiled from `source` (cached by its text, as the checkout's are)."""
    return _load(_build(source))


@torch.inference_mode()
def same_logits(a: Transformer, b: Transformer) -> bool:
    """Whether both forwards give the same logits for a prompt, then a verify of 6 after it."""
    prompt, drafts = [(7 * i) % a.config.vocab_size for i in range(120)], [5, 9, 11, 3, 2, 8]
    outs = []
    for model in (a, b):
        cache = model.new_cache(1, 256)
        slot = cache.allocate()
        first = model(model.batch(cache, [slot], [prompt]), cache).logits
        outs.append((first, model(model.batch(cache, [slot], [drafts]), cache).logits))
    return all(torch.equal(x, y) for x, y in zip(*outs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", type=Path, help="another kernels.c")
    parser.add_argument("--model", default="models/target")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if library() is None:
        raise SystemExit(f"no compiled forward here: {problem()}")
    checkout = load_checkpoint(args.model, dtype=args.dtype).model
    other = load_checkpoint(args.model, dtype=args.dtype).model
    other.native = NativeForward(other, build(args.other))
    print(f"{args.model} ({args.dtype}), {torch.get_num_threads()} threads, median ms of {args.repeats} repeats")
    print(f"same logits bit for bit: {same_logits(checkout, other)}")
    print(f"{'forward':<28} {args.other.name:>14} {'checkout':>14} {'speed-up':>10}")
    for name, rows, width, start, count in SHAPES:
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(args.repeats):
            for timed, model in zip(times, (other, checkout)):
                timed.append(time_forward(model, rows, width, start, count))
        theirs, ours = (statistics.median(t) for t in times)
        print(f"{name:<28} {theirs:>14.3f} {ours:>14.3f} {theirs / ours:>9.3f}x")


if __name__ == "__main__":
    main()
