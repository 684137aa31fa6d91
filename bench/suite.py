"""Every workload of the suite, every mode side by side, and how adapting k compares overall.

    python -m bench.suite [--split heldout] [--concurrency 1,4] [--config config.toml]
        [--modes none,static:1,static:2,static:3,static:5,static:7,adaptive:ema,adaptive:measured,adaptive:positional]
        [--published] [--requests N] [--repeats 1] [--json OUT] [--plots DIR]

Runs each workload of bench/workloads/suite/ (NAME.SPLIT.jsonl; --split tune, heldout or all)
at each concurrency as `python -m bench.spec` does: all modes on the same loaded models, taking
turns a round at a time. Prints each workload's table, then per concurrency the two summary
figures, geometric means over the workloads, for each adaptive mode:

- against the best single static k over the suite: the static mode (`none` counts as k = 0)
  whose geometric mean over the workloads is highest, the one k a user who must pick one sets;
- against the best static k of each workload, chosen in hindsight, and the worst workload;
  that again on decoding time alone: prefill is the same work in every mode, and where it is a
  large share of the time (few requests, a slow model) its noise would land in the ratios.

--published runs the published model instead of the default pair (bench/published.py: SmolLM2's
GGUF with the n-gram drafter), so that a policy change is judged on a model nobody here trained;
--requests N serves N of each workload's requests, spread over the file so that every phase keeps
its share (that model decodes about 8 times slower than the default target on a CPU).

Choose nothing by looking at the held-out half (bench/workloads/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from bench.published import DRAFTER, published_target
from bench.report import plot, print_table
from bench.spec import ROOT, bench_snapshot, drafters_of, run_modes, warm_up
from bench.workload import WorkItem, read_workload
from control.arguments import at_least, integers
from control.assemble import load_models
from engine.model.config import DRAFTERS

SUITE = Path(__file__).resolve().parent / "workloads" / "suite"
MODES = "none,static:1,static:2,static:3,static:5,static:7,adaptive:ema,adaptive:measured,adaptive:positional"


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def spread(items: list[WorkItem], n: int | None) -> list[WorkItem]:
    """n of the items, evenly spaced through them in their order (all of them where n is None)."""
    if n is None or n >= len(items):
        return items
    return [items[i * len(items) // n] for i in range(n)]


def is_static(mode: str) -> bool:
    return mode == "none" or mode.startswith("static:")


def summarize(rates: dict[str, dict[str, float]]) -> dict:
    """rates[workload][mode] in tokens/s -> the suite's summary figures for every adaptive mode."""
    workloads = sorted(rates)
    modes = list(rates[workloads[0]])
    statics = [m for m in modes if is_static(m)]
    single = max(statics, key=lambda m: geomean([rates[w][m] for w in workloads]))
    summary: dict = {"best_single_static": single, "adaptive": {}}
    for mode in (m for m in modes if not is_static(m)):
        per_workload = {w: rates[w][mode] / max(rates[w][s] for s in statics) for w in workloads}
        worst = min(per_workload, key=per_workload.__getitem__)
        summary["adaptive"][mode] = {
            "vs_best_single_static": geomean([rates[w][mode] / rates[w][single] for w in workloads]),
            "vs_best_static_per_workload": geomean(list(per_workload.values())),
            "worst_workload": worst,
            "worst_vs_its_best_static": per_workload[worst],
            "per_workload": per_workload,
        }
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", choices=["tune", "heldout", "all"], default="heldout")
    parser.add_argument("--workloads", type=Path, default=SUITE, help="a folder of NAME.SPLIT.jsonl files")
    parser.add_argument("--concurrency", type=integers(1), default=[1, 4])
    parser.add_argument("--modes", default=MODES)
    parser.add_argument("--repeats", type=at_least(1), default=1)
    parser.add_argument(
        "--config", type=Path, default=ROOT / "config.toml", help="as bench.spec's (the daemon's default)"
    )
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--drafter", choices=DRAFTERS[:-1], default=None)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--published", action="store_true", help="the published model (bench/published.py)")
    parser.add_argument("--requests", type=at_least(1), default=None, help="N of each workload's requests")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plots", type=Path, default=None, help="a folder for one k-and-throughput plot a run")
    args = parser.parse_args(argv)

    pattern = "*.jsonl" if args.split == "all" else f"*.{args.split}.jsonl"
    files = sorted(args.workloads.glob(pattern))
    if not files:
        raise SystemExit(f"{args.workloads}: no {pattern} workloads")
    if args.published:
        args.target = args.target or str(published_target())
        args.drafter = args.drafter or DRAFTER
    snapshot = bench_snapshot(args)
    print(f"suite {args.split}: target {snapshot.engine.target}, drafter {snapshot.engine.drafter}", file=sys.stderr)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    models = load_models(snapshot, kinds=drafters_of(modes))
    warm_up(snapshot, models, read_workload(files[0]), 1, args.max_seq_len)
    if args.plots:
        args.plots.mkdir(parents=True, exist_ok=True)

    results: dict = {"split": args.split, "modes": modes, "concurrency": {}}
    for concurrency in args.concurrency:
        rates: dict[str, dict[str, float]] = {}
        decoding: dict[str, dict[str, float]] = {}  # prefill, the same work in every mode, left out
        tables: dict[str, dict] = {}
        for path in files:
            name = path.name.removesuffix(".jsonl")
            items = spread(read_workload(path), args.requests)
            reports = run_modes(modes, items, snapshot, models, concurrency, args.max_seq_len, args.repeats)
            print(f"\n== {name}, concurrency {concurrency} ({len(items)} requests)")
            print_table(reports)
            sys.stdout.flush()
            rates[name] = {mode: r.tokens / r.seconds for mode, r in reports.items()}
            decoding[name] = {mode: r.tokens / (r.seconds - r.prefill_seconds) for mode, r in reports.items()}
            tables[name] = {mode: r.as_json() for mode, r in reports.items()}
            if args.plots:
                out = args.plots / f"{name}.c{concurrency}.png"
                plot(reports, out, window=max(1.0, max(r.seconds for r in reports.values()) / 40))
        summary, decoded = summarize(rates), summarize(decoding)
        results["concurrency"][str(concurrency)] = {
            "workloads": tables,
            "tokens_per_s": rates,
            "summary": summary,
            "decoding_summary": decoded,
        }
        print(
            f"\n== suite ({args.split}), concurrency {concurrency}: best single static {summary['best_single_static']}"
        )
        for mode, s in summary["adaptive"].items():
            d = decoded["adaptive"][mode]
            print(
                f"  {mode}: {s['vs_best_single_static']:.3f}x the best single static k, "
                f"{s['vs_best_static_per_workload']:.3f}x each workload's best static k "
                f"(worst: {s['worst_workload']} {s['worst_vs_its_best_static']:.3f}x); on decoding time alone "
                f"{d['vs_best_static_per_workload']:.3f}x "
                f"(worst: {d['worst_workload']} {d['worst_vs_its_best_static']:.3f}x)"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
