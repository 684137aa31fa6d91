"""What turning logits into a sampled token costs: top-p by buckets against a full sort.

    python -m bench.sampling [--repeats 200]

Real logits of the default target on held-out code prompts, at temperature 1 and 0.7, top_p 0.95,
for one row (a draft step) and six rows (a verify of five drafts). Three top-p filters take turns
call by call: a full sort, buckets by tensor operators, and buckets in the compiled kernels (what
a CPU serves with). Prints the median microseconds of each and the sort's time over each. All
keep the same tokens (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.checkpoint import load_checkpoint
from engine.generate import generate
from engine.sampling import SamplingParams, nucleus, nucleus_by_operators
from tools.corpus import code_prompts


def sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The textbook filter: sort the whole vocabulary, keep the prefix whose mass before each
    token is under top_p."""
    ordered, order = probs.sort(dim=-1, descending=True)
    ordered = ordered.masked_fill(ordered.cumsum(dim=-1) - ordered >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, ordered)
    return kept / kept.sum(dim=-1, keepdim=True)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    checkpoint = load_checkpoint("models/target")
    model = checkpoint.model
    prompts = [checkpoint.tokenizer.encode(p).ids for p in code_prompts(4, seed=5)]
    outputs = generate(checkpoint, prompts, SamplingParams(max_tokens=8))
    contexts = [p + o.tokens for p, o in zip(prompts, outputs)]
    cache = model.new_cache(1, max(len(c) for c in contexts) + 1)
    slot = cache.allocate()
    logits = []
    for context in contexts:
        cache.truncate(slot, 0)
        logits.append(model(model.batch(cache, [slot], [context]), cache).logits[0, -6:])
    header = ("temperature", "rows", "sorted (us)", "operators (us)", "kernels (us)", "speed-ups")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (11, 4, 11, 14, 12, 14))))
    for temperature in (1.0, 0.7):
        for rows in (1, 6):
            inputs = [torch.softmax(x[-rows:].float() / temperature, dim=-1) for x in logits]
            filters = {"sorted": sorted_nucleus, "operators": nucleus_by_operators, "kernels": nucleus}
            timings: dict[str, list[float]] = {name: [] for name in filters}
            for i in range(args.repeats):
                probs = inputs[i % len(inputs)]
                for name, method in filters.items():
                    began = time.perf_counter()
                    method(probs, 0.95)
                    timings[name].append(time.perf_counter() - began)
            for probs in inputs:
                expected = sorted_nucleus(probs, 0.95) > 0
                assert torch.equal(expected, nucleus_by_operators(probs, 0.95) > 0)
                assert torch.equal(expected, nucleus(probs, 0.95) > 0)
            slow, buckets, kernels = (statistics.median(t) * 1e6 for t in timings.values())
            ratios = f"{slow / buckets:.2f}x / {slow / kernels:.2f}x"
            print(f"{temperature:>11} {rows:>4} {slow:>11.1f} {buckets:>14.1f} {kernels:>12.1f} {ratios:>14}")


if __name__ == "__main__":
    main()
