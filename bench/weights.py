"""What engine.weights costs and saves on the default target: each quantized layout's top-1
agreement with float32, teacher-forced over held-out code, and batch-1 decode speed against
bfloat16 (the default models' stored dtype).

    python -m bench.weights [--model models/target] [--prompts 4] [--tokens 64]

Agreement: every position of --prompts held-out prompts (the standard library's test files,
tools/corpus.py) is fed the true text, and the quantized target's argmax is compared with
float32's. Speed: --tokens greedy tokens after a short prompt, at batch 1 on the compiled forward,
each layout twice in turn.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.checkpoint import Checkpoint, load_checkpoint
from engine.generate import generate
from engine.model.transformer import ForwardBatch
from engine.sampling import SamplingParams
from tools.corpus import code_prompts


@torch.inference_mode()
def argmaxes(checkpoint: Checkpoint, prompts: list[list[int]]) -> torch.Tensor:
    """The target's next-token choice at every position of every prompt, fed the prompt itself."""
    model, chosen = checkpoint.model, []
    for prompt in prompts:
        cache = model.new_cache(1, len(prompt))
        slot = cache.allocate()
        batch = ForwardBatch.build(cache, [slot], [prompt], model.config.sliding_window)
        chosen.append(model(batch, cache).logits[0].argmax(-1))
    return torch.cat(chosen)


def decode_rate(checkpoint: Checkpoint, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    made = sum(len(c.tokens) for c in generate(checkpoint, [prompt], params))
    return made / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/target")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    served = {
        "float32": load_checkpoint(args.model, dtype="float32"),
        "bfloat16": load_checkpoint(args.model, dtype="bfloat16"),
        "int8": load_checkpoint(args.model, weights="int8"),
        "int4": load_checkpoint(args.model, weights="int4"),
    }
    tokenizer = served["float32"].tokenizer
    prompts = [tokenizer.encode(text).ids for text in code_prompts(args.prompts, seed=0)]
    exact = argmaxes(served["float32"], prompts)
    print(f"{len(exact)} held-out positions ({len(prompts)} prompts), teacher-forced top-1 agreement with float32:")
    for name in ("bfloat16", "int8", "int4"):
        agree = (argmaxes(served[name], prompts) == exact).float().mean().item()
        print(f"  {name}: {100 * agree:.1f}%")

    prompt = prompts[0][:32]
    rates: dict[str, list[float]] = {name: [] for name in ("bfloat16", "int8", "int4")}
    for _ in range(2):
        for name in rates:
            rates[name].append(decode_rate(served[name], prompt, args.tokens))
    print(f"batch-1 greedy decode, {args.tokens} tokens, {torch.get_num_threads()} threads (best of 2):")
    for name, measured in rates.items():
        print(f"  {name}: {max(measured):.0f} tok/s ({max(measured) / max(rates['bfloat16']):.2f}x bfloat16)")


if __name__ == "__main__":
    main()
