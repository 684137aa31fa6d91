"""How often the default draft agrees with the default target on held-out code.

    python -m bench.acceptance [--prompts 24] [--steps 4] [--max-tokens 96]

Prompts are cut from the standard library's test files (held out from training); decoding is
greedy with the draft proposing --steps tokens per round. Prints the mean number of accepted
drafts per round, the acceptance rate at each chain position, and target-only tokens/s at batch 1.
"""

from __future__ import annotations

import argparse
import time

from bench.prompts import code_prompts
from engine.checkpoint import load_checkpoint
from engine.core import Engine
from engine.drafters import DraftModelDrafter
from engine.generate import generate
from engine.request import Request
from engine.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/target")
    parser.add_argument("--draft", default="models/draft")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    target, draft = load_checkpoint(args.target), load_checkpoint(args.draft)
    prompts = [target.tokenizer.encode(p).ids for p in code_prompts(args.prompts, args.seed)]
    params = SamplingParams(max_tokens=args.max_tokens)
    batch = 4
    max_seq_len = max(len(p) for p in prompts) + args.max_tokens + 1
    engine = Engine(target, DraftModelDrafter(draft, batch, max_seq_len), batch, max_seq_len, [args.steps])
    engine.run_until_done(Request(tuple(p), params) for p in prompts)
    stats = engine.state.stats
    verified_rounds = stats.proposed_at[0] if stats.proposed_at else 0
    print(f"{len(prompts)} held-out prompts, greedy, k={args.steps}, up to {args.max_tokens} tokens each")
    print(f"mean accepted drafts per round: {stats.drafts_accepted / max(verified_rounds, 1):.3f}")
    rates = [a / p for a, p in zip(stats.accepted_at, stats.proposed_at) if p]
    print("acceptance by position (of all rounds): " + ", ".join(f"{r:.3f}" for r in rates))

    generate(target, [prompts[0]], SamplingParams(max_tokens=8))  # warm-up
    started = time.perf_counter()
    fixed = SamplingParams(max_tokens=64, ignore_eos=True)
    produced = sum(len(generate(target, [p], fixed)[0].tokens) for p in prompts[:4])
    seconds = time.perf_counter() - started
    print(f"target-only decoding at batch 1: {produced / seconds:.1f} tokens/s")


if __name__ == "__main__":
    main()
