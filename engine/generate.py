"""Target-only generation: the reference that speculative decoding must reproduce.

python -m engine.generate --model models/target "def fibonacci(n):"
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.checkpoint import Checkpoint, load_checkpoint
from engine.detokenize import OutputText
from engine.device.resolve import DeviceError
from engine.model.config import CheckpointError
from engine.request import finish_reason
from engine.sampling import SamplingParams, next_token


@dataclass
class Completion:
    prompt_tokens: list[int]
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


@torch.inference_mode()
def generate(
    checkpoint: Checkpoint,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
) -> list[Completion]:
    """Decode every prompt with the target alone, all in one batch."""
    model, tokenizer = checkpoint.model, checkpoint.tokenizer
    all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    max_len = max(len(p) + sp.max_tokens for p, sp in zip(prompts, all_params))
    cache = model.new_cache(len(prompts), max_len)
    slots = [cache.allocate() for _ in prompts]
    generators = [sp.generator(checkpoint.device) for sp in all_params]
    outputs: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    texts = [OutputText(tokenizer, sp.stop) if sp.stop else None for sp in all_params]

    active = list(range(len(prompts)))
    pending = [list(p) for p in prompts]  # tokens each sequence feeds next
    while active:
        batch = model.batch(cache, [slots[i] for i in active], [pending[i] for i in active])
        logits = model(batch, cache, last_only=True).logits[:, -1]
        still = []
        for row, i in enumerate(active):
            token = next_token(logits[row], all_params[i], generators[i])
            outputs[i].append(token)
            text = texts[i]
            if text is not None:
                text.push([token])
            reasons[i] = finish_reason(outputs[i], all_params[i], checkpoint.eos_token_ids, text)
            pending[i] = [token]
            if reasons[i] is None:
                still.append(i)
        active = still
    return [Completion(list(p), out, r or "length") for p, out, r in zip(prompts, outputs, reasons)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m engine.generate", description="Generate text with the target model alone."
    )
    parser.add_argument("prompts", nargs="+", help="one or more prompts, decoded as one batch")
    parser.add_argument("--model", default="models/target", help="Hugging Face checkpoint directory or GGUF file")
    parser.add_argument("--device", default="cpu", help="cpu, cuda[:N] or npu[:N]")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens to generate for each prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the nucleus of this mass")
    parser.add_argument("--seed", type=int, default=None, help="repeat a sampled run")
    args = parser.parse_args(argv)
    try:  # what the user asked for is checked before the model loads
        params = SamplingParams(args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as err:
        parser.error(str(err))
    try:
        checkpoint = load_checkpoint(args.model, args.device, args.dtype)
    except (CheckpointError, DeviceError, ValueError) as err:
        raise SystemExit(f"{parser.prog}: {err}") from None
    prompts = [checkpoint.tokenizer.encode(p).ids for p in args.prompts]
    positions = checkpoint.model.config.max_position_embeddings
    if (longest := max(len(p) for p in prompts) + params.max_tokens) > positions:
        raise SystemExit(
            f"{parser.prog}: the longest prompt and --max-tokens need {longest} positions; the model has {positions}"
        )
    started = time.perf_counter()
    completions = generate(checkpoint, prompts, params)
    seconds = time.perf_counter() - started
    for prompt, completion in zip(args.prompts, completions):
        print(prompt + checkpoint.tokenizer.decode(completion.tokens))
        print("-" * 60)
    total = sum(len(c.tokens) for c in completions)
    print(f"{total} tokens in {seconds:.2f} s ({total / seconds:.1f} tokens/s)", file=sys.stderr)


if __name__ == "__main__":
    main()
