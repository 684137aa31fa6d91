"""Target-only decoding: adaspec's runtime against transformers' `generate`, side by side.

    python -m bench.target_only [--model models/target] [--tokens 128] [--repeats 3]

Both decode the same prompts greedily for exactly --tokens new tokens (EOS ignored), at batch 1
and batch 4; runs alternate between the two so machine noise hits both alike. Prints tokens/s
for each and the ratio adaspec / transformers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.checkpoint import load_checkpoint
from engine.generate import generate
from engine.sampling import SamplingParams

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    'def parse_header(line):\n    """Parse a header line."""\n',
    "for index, item in enumerate(items):\n",
]


def run_adaspec(checkpoint, prompts: list[list[int]], tokens: int) -> int:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return sum(len(c.tokens) for c in generate(checkpoint, prompts, params))


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
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    pad_id = min(checkpoint.eos_token_ids) if checkpoint.eos_token_ids else 0
    encoded = [checkpoint.tokenizer.encode(p).ids for p in PROMPTS]
    params = sum(p.numel() for p in checkpoint.model.parameters())
    threads = torch.get_num_threads()
    print(f"model {args.model}: {params / 1e6:.1f}M parameters, {threads} threads, {args.tokens} new tokens")
    print(f"{'batch':>5} {'adaspec tok/s':>14} {'transformers tok/s':>19} {'ratio':>6}")
    for batch in (1, 4):
        prompts = encoded[:batch]
        run_adaspec(checkpoint, prompts, 8)  # warm-up both
        run_transformers(reference, prompts, 8, pad_id)
        ours, theirs = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            n = run_adaspec(checkpoint, prompts, args.tokens)
            ours.append(n / (time.perf_counter() - started))
            started = time.perf_counter()
            n = run_transformers(reference, prompts, args.tokens, pad_id)
            theirs.append(n / (time.perf_counter() - started))
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"{batch:>5} {a:>14.1f} {b:>19.1f} {a / b:>5.2f}x")


if __name__ == "__main__":
    main()
