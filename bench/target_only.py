"""Target-only decoding: adaspec's runtime against transformers' `generate`, side by side.

    python -m bench.target_only [--model models/target] [--tokens 128] [--repeats 3]

Every runner decodes the same prompts greedily for exactly --tokens new tokens (EOS ignored), at
batch 1, 4 and 8; runs alternate between them so machine noise hits all alike. The runners:
`generate` (engine.generate, the plain decode loop) and `engine` (the serving engine's round,
Engine.step with k = 0) on the compiled CPU forward, `generate` on PyTorch operators, and
transformers. Prints tokens/s for each and each one's ratio to transformers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.checkpoint import load_checkpoint
from engine.core import Engine
from engine.generate import generate
from engine.native.build import problem
from engine.request import Request
from engine.sampling import SamplingParams

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    'def parse_header(line):\n    """Parse a header line."""\n',
    "for index, item in enumerate(items):\n",
]


def run_generate(checkpoint, prompts: list[list[int]], tokens: int) -> int:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return sum(len(c.tokens) for c in generate(checkpoint, prompts, params))


def run_engine(checkpoint, prompts: list[list[int]], tokens: int) -> int:
    engine = Engine(checkpoint, None, len(prompts), max(map(len, prompts)) + tokens, [0], max_k=0)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    outputs = engine.run_until_done(Request(tuple(p), params) for p in prompts)
    return sum(len(o) for o in outputs.values())


@torch.inference_mode()
def run_transformers(model, prompts: list[list[int]], tokens: int, pad_id: int) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return (out.shape[1] - width) * len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/target")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    checkpoint = load_checkpoint(args.model)
    operators = load_checkpoint(args.model, native_forward=False)
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    pad_id = min(checkpoint.eos_token_ids) if checkpoint.eos_token_ids else 0
    encoded = [checkpoint.tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids for i in range(8)]
    params = sum(p.numel() for p in checkpoint.model.parameters())
    threads = torch.get_num_threads()
    forward = "compiled forward" if checkpoint.model.native is not None else f"no compiled forward: {problem()}"
    print(f"model {args.model}: {params / 1e6:.1f}M parameters, {threads} threads, {args.tokens} new tokens, {forward}")
    runners = {
        "generate": lambda prompts, n: run_generate(checkpoint, prompts, n),
        "engine k=0": lambda prompts, n: run_engine(checkpoint, prompts, n),
        "generate (PyTorch ops)": lambda prompts, n: run_generate(operators, prompts, n),
        "transformers": lambda prompts, n: run_transformers(reference, prompts, n, pad_id),
    }
    print(f"{'batch':>5} " + " ".join(f"{name:>24}" for name in runners) + "   (tok/s, x transformers)")
    for batch in (1, 4, 8):
        prompts = encoded[:batch]
        rates: dict[str, list[float]] = {name: [] for name in runners}
        for run in runners.values():
            run(prompts, 8)  # warm-up
        for _ in range(args.repeats):
            for name, run in runners.items():
                started = time.perf_counter()
                n = run(prompts, args.tokens)
                rates[name].append(n / (time.perf_counter() - started))
        medians = {name: statistics.median(r) for name, r in rates.items()}
        base = medians["transformers"]
        print(f"{batch:>5} " + " ".join(f"{f'{m:.1f} ({m / base:.2f}x)':>24}" for m in medians.values()))


if __name__ == "__main__":
    main()
