"""How often a drafter's drafts agree with the default target on held-out code.

    python -m bench.acceptance [--drafter draft_model|dflash|eagle3] [--prompts 24] [--steps 4]
        [--max-tokens 96]

Prompts are cut from the standard library's test files (held out from training); decoding is
greedy with the drafter (the draft model by default, or the DFlash drafter or EAGLE-3 head the
config names) proposing --steps tokens per round. Prints the mean number of accepted
drafts per round, the acceptance rate at each chain position, and target-only tokens/s at batch 1.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from bench.spec import ROOT
from control.arguments import at_least
from control.assemble import build_drafter, load_models
from control.load import load_config
from engine.core import Engine
from engine.generate import generate
from engine.request import Request
from engine.sampling import SamplingParams
from tools.corpus import code_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/target")
    parser.add_argument("--draft", default="models/draft")
    parser.add_argument("--drafter", default="draft_model", choices=("draft_model", "dflash", "eagle3"))
    parser.add_argument("--dflash", default="models/dflash")
    parser.add_argument("--eagle3", default="models/eagle3")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--k", "--steps", dest="k", type=at_least(0), default=4, help="the draft length served")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    config = load_config(ROOT / "config.toml")
    paths = {name: Path(getattr(args, name)) for name in ("target", "draft", "dflash", "eagle3")}
    snapshot = replace(config, engine=replace(config.engine, drafter=args.drafter, **paths))
    models = load_models(snapshot)
    target = models.target
    prompts = [target.tokenizer.encode(p).ids for p in code_prompts(args.prompts, args.seed)]
    params = SamplingParams(max_tokens=args.max_tokens)
    batch = 4
    max_seq_len = max(len(p) for p in prompts) + args.max_tokens + 1
    drafter = build_drafter(snapshot.engine, models, batch, max_seq_len)
    try:
        engine = Engine(target, drafter, batch, max_seq_len, [args.k])
    except ValueError as err:  # a k the drafter cannot draft (a DFlash block's size - 1 at most)
        parser.error(f"--k {args.k}: {err}")
    engine.run_until_done(Request(tuple(p), params) for p in prompts)
    stats = engine.states[args.k].stats
    verified_rounds = stats.proposed_at[0] if stats.proposed_at else 0
    print(f"{len(prompts)} held-out prompts, {args.drafter}, greedy, k={args.k}, up to {args.max_tokens} tokens each")
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
