"""What a round costs beyond its forwards, at batch 1 and 8.

    python -m bench.round_overhead [--tokens 96] [--prompts 16]

Serves held-out code prompts (greedy) with the default pair at a static k of 0 and 3, and a
sampled run at k = 3, and times every round (`Engine.step`) and, inside it, every model forward
(target and draft). What is left is the round's own work: admission, drafting's bookkeeping,
verification's sampling and acceptance, stop checks, emitting and retiring. Prints per round the
milliseconds of each and the share of the round that is not a forward.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.checkpoint import load_checkpoint
from engine.core import Engine
from engine.drafters.draft_model import DraftModelDrafter
from engine.model.transformer import Transformer
from engine.request import Request
from engine.sampling import SamplingParams
from tools.corpus import code_prompts


@contextmanager
def timed_forwards(models: list[Transformer], spent: list[float]) -> Iterator[None]:
    """Add the wall time of every forward of `models` to spent[0], a greedy chain's forwards run
    whole in the compiled kernels (`greedy_chain`) included."""

    def wrap(forward):  # type: ignore[no-untyped-def]
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            began = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - began

        return timed

    wrapped = [(model, "forward") for model in models]
    wrapped += [(model.native, "greedy_chain") for model in models if model.native is not None]
    for owner, name in wrapped:
        setattr(owner, name, wrap(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name in wrapped:
            delattr(owner, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    target, draft = load_checkpoint("models/target"), load_checkpoint("models/draft")
    prompts = [tuple(target.tokenizer.encode(p).ids) for p in code_prompts(args.prompts, seed=3)]
    print(f"{len(prompts)} held-out code prompts, {args.tokens} tokens, {torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'k':>2} {'sampling':>8} {'round ms':>9} {'forwards ms':>12} {'rest ms':>8} {'rest':>6}")
    for batch in (1, 8):
        for k, temperature in ((0, 0.0), (3, 0.0), (3, 1.0)):
            drafter = DraftModelDrafter(draft, batch, 2048) if k else None
            engine = Engine(target, drafter, batch, 2048, [k], max_k=max(k, 1))
            models = [target.model] + ([drafter.model] if drafter is not None else [])
            params = SamplingParams(max_tokens=args.tokens, temperature=temperature, seed=1)
            for prompt in prompts:
                engine.add_request(Request(prompt, params))
            spent, rounds, total = [0.0], 0, 0.0
            with timed_forwards(models, spent):
                while engine.has_work:
                    began = time.perf_counter()
                    engine.step(k)
                    total += time.perf_counter() - began
                    rounds += 1
            rest = total - spent[0]
            print(
                f"{batch:>5} {k:>2} {'yes' if temperature else 'greedy':>8} {total / rounds * 1e3:>9.3f} "
                f"{spent[0] / rounds * 1e3:>12.3f} {rest / rounds * 1e3:>8.3f} {rest / total:>6.1%}"
            )


if __name__ == "__main__":
    main()
