"""Static draft lengths against no speculation, for each drafter, at batch 1 and 4.

    python -m bench.static_k [--prompts 8] [--max-tokens 128]

Code prompts from the held-out standard-library tests, temperature 0. Every configuration
serves the same requests on the same loaded models in this one process; ratios are to no
speculation at the same batch size.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from bench.side_by_side import run_mode
from bench.spec import ROOT, build_controller
from bench.workload import WorkItem
from control.assemble import load_models
from control.load import load_config
from engine.sampling import SamplingParams
from tools.corpus import code_prompts

STEPS = (1, 3, 5, 7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/target")
    parser.add_argument("--draft", default="models/draft")
    parser.add_argument("--dflash", default="models/dflash", help="a DFlash drafter, compared where it exists")
    parser.add_argument("--eagle3", default="models/eagle3", help="an EAGLE-3 head, compared where it exists")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--no-quantize", dest="quantize", action="store_false", help="run the draft in float32, not int8"
    )
    args = parser.parse_args()

    config = load_config(ROOT / "config.toml")
    engine = replace(
        config.engine,
        target=Path(args.target),
        draft=Path(args.draft),
        drafter="draft_model",
        draft_quantization="int8" if args.quantize else "none",
        dflash=Path(args.dflash),
        eagle3=Path(args.eagle3),
    )
    snapshot = replace(config, engine=engine)
    has_dflash = (Path(args.dflash) / "config.json").exists()
    kinds = ["draft_model", "ngram", "hybrid"] + (["dflash", "hybrid_dflash"] if has_dflash else [])
    kinds += ["eagle3", "hybrid_eagle3"] if (Path(args.eagle3) / "config.json").exists() else []
    models = load_models(snapshot, kinds=kinds)
    tokenizer = models.target.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens)
    items = [WorkItem(p, params, "code", None) for p in code_prompts(args.prompts, args.seed)]
    max_seq_len = 2048
    draft_kind = "int8" if args.quantize else "float32"
    print(f"{len(items)} held-out code prompts, greedy, {args.max_tokens} tokens each, draft model in {draft_kind}")
    print(f"{'batch':>5} {'drafter':<12} {'mode':<9} {'tok/s':>8} {'x none':>7} {'acc/round':>9}")
    for batch in (1, 4):
        run_mode(build_controller("static:3", snapshot, models, batch, max_seq_len), items[:batch], tokenizer, batch)
        none = run_mode(build_controller("none", snapshot, models, batch, max_seq_len), items, tokenizer, batch)
        base = none.tokens / none.seconds
        print(f"{batch:>5} {'-':<12} {'none':<9} {base:>8.1f} {'1.00x':>7} {'-':>9}")
        for name in kinds:
            for k in STEPS:
                controller = build_controller(f"static:{k}+drafter={name}", snapshot, models, batch, max_seq_len)
                r = run_mode(controller, items, tokenizer, batch)
                rate = r.tokens / r.seconds
                print(
                    f"{batch:>5} {name:<12} {'k=' + str(k):<9} {rate:>8.1f} {rate / base:>6.2f}x "
                    f"{r.accepted / max(r.verified, 1):>9.2f}"
                )


if __name__ == "__main__":
    main()
