"""Speculative round time at batch 1, eager against graph replay, for each k (CUDA only).

    python -m bench.graphs [--target models/target] [--drafter draft_model|eagle3|dflash]
        [--draft models/draft] [--eagle3 models/eagle3] [--dflash models/dflash] [--dtype auto]
        [--steps 0,1,3,5,7] [--prompts 4] [--max-tokens 128]

Both engines serve the same greedy code prompts on the same loaded models, one request at a time.
A round's time is draft + verify wall time as the engine records it (each round reads tokens
back to the host, so it is synchronous). Also prints what capturing each state cost. Without a
CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

from control.arguments import integers
from engine.checkpoint import load_checkpoint
from engine.core import Engine
from engine.drafters.base import Drafter
from engine.drafters.dflash import DFlashDrafter
from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.eagle3 import Eagle3Drafter
from engine.model.dflash import load_dflash
from engine.model.eagle3 import load_eagle3
from engine.request import Request
from engine.sampling import SamplingParams
from tools.corpus import code_prompts

MAX_SEQ_LEN = 2048


def round_seconds(engine: Engine, requests: list[Request]) -> float:
    """Mean seconds per round over `requests`, served one at a time after a warm-up request."""
    engine.run_until_done(requests[:1])
    stats = engine.states[max(engine.states)].stats
    rounds, seconds = stats.rounds, stats.draft_seconds + stats.verify_seconds
    for request in requests:
        engine.run_until_done([Request(request.prompt, request.params)])
    engine.backend.synchronize()
    return (stats.draft_seconds + stats.verify_seconds - seconds) / max(stats.rounds - rounds, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/target")
    parser.add_argument("--drafter", choices=("draft_model", "eagle3", "dflash"), default="draft_model")
    parser.add_argument("--draft", default="models/draft")
    parser.add_argument("--eagle3", default="models/eagle3")
    parser.add_argument("--dflash", default="models/dflash")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--k", "--steps", dest="k", type=integers(0), default=[0, 1, 3, 5, 7], help="draft lengths, comma-separated"
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench.graphs: CUDA is required (graph replay is measured on a CUDA device); nothing to measure here.")
        return

    dtype = None if args.dtype == "auto" else args.dtype
    target = load_checkpoint(args.target, "cuda", dtype)
    make: Callable[[], Drafter]
    if args.drafter == "eagle3":
        head = load_eagle3(args.eagle3, target.model)
        make = partial(Eagle3Drafter, head, target.model, 1, MAX_SEQ_LEN)
    elif args.drafter == "dflash":
        block = load_dflash(args.dflash, target.model)
        make = partial(DFlashDrafter, block, target.model, 1, MAX_SEQ_LEN)
    else:
        draft = load_checkpoint(args.draft, "cuda", dtype)
        make = partial(DraftModelDrafter, draft, 1, MAX_SEQ_LEN)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    limit = MAX_SEQ_LEN - args.max_tokens
    requests = [Request(tuple(target.tokenizer.encode(p).ids[-limit:]), params) for p in code_prompts(args.prompts)]
    steps = args.k
    print(f"{torch.cuda.get_device_name()}, {target.model.embed_tokens.weight.dtype}, {args.drafter}, batch 1, greedy")
    print(f"{'k':>2} {'eager ms':>9} {'graphs ms':>9} {'speedup':>8} {'capture s':>9} {'capture MiB':>11}")
    for k in steps:
        times = {}
        for graphs in (False, True):
            engine = Engine(target, make(), 1, MAX_SEQ_LEN, [k], graphs=graphs)
            times[graphs] = round_seconds(engine, requests)
            state = engine.states[k]
        print(
            f"{k:>2} {times[False] * 1e3:>9.3f} {times[True] * 1e3:>9.3f} {times[False] / times[True]:>7.2f}x "
            f"{state.build_seconds:>9.2f} {state.memory_bytes / 2**20:>11.1f}"
        )


if __name__ == "__main__":
    main()
