"""Time to first token with prompts prefilled through piecewise graphs, against eager prefill.

    python -m bench.prefill [--config config.toml] [--device cuda] [--prompts 24] [--repeats 3]
        [--drafter KIND]

Two engines on the same loaded models (the config's, moved to --device): one prefills through
graphs (`prefill_graph_tokens` as configured, 2048 by default), the other eagerly. Each held-out
code prompt of the suite (`code-greedy.heldout.jsonl`: lengths the engines have not seen) is sent
alone at batch 1 to each in turn, --repeats times over; a prompt's time to first token is its
admitting round's wall time, the device synchronised. Prints the median of each engine, their
ratio, the share of prompt tokens the graphs served, the fallbacks by reason, and whether the two
engines' first 32 greedy tokens agree on every prompt. Needs a device whose backend allows prefill
graphs (CUDA); elsewhere it says why and exits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench.spec import ROOT, bench_snapshot
from bench.workload import read_workload
from control.arguments import at_least
from control.assemble import build_drafter, load_models
from engine.core import Engine, StepResult
from engine.device.backend import backend_for
from engine.device.prefill import DEFAULT_MAX_TOKENS, eager_prefill
from engine.request import Request
from engine.sampling import SamplingParams

PROMPTS = Path(__file__).resolve().parent / "workloads" / "suite" / "code-greedy.heldout.jsonl"


def first_token_seconds(engine: Engine, prompt: tuple[int, ...], tokens: int) -> tuple[float, list[int], StepResult]:
    """The admitting round's wall time, the first `tokens` greedy tokens, and that round."""
    backend = engine.backend
    request = Request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    engine.add_request(request)
    backend.synchronize()
    started = time.perf_counter()
    result = engine.step(0)
    backend.synchronize()
    seconds = time.perf_counter() - started
    out = [t for o in result.outputs for t in o.new_tokens]
    while engine.has_work:
        out += [t for o in engine.step(3 if 3 in engine.states else 0).outputs for t in o.new_tokens]
    return seconds, out, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "config.toml")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=at_least(1), default=24)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--drafter", default=None, help="as [engine] drafter; 'none' times the target alone")
    args = parser.parse_args(argv)
    args.target = args.draft = None
    snapshot = bench_snapshot(args)
    settings = replace(snapshot.engine, device=args.device)
    snapshot = replace(snapshot, engine=settings)
    backend = backend_for(args.device)
    most = settings.prefill_graph_tokens or DEFAULT_MAX_TOKENS
    if (why := eager_prefill(backend, most)) is not None:
        raise SystemExit(f"bench.prefill: {args.device}: {why}")
    models = load_models(snapshot)
    tokenizer = models.target.tokenizer
    prompts = [tuple(tokenizer.encode(item.prompt).ids) for item in read_workload(PROMPTS)[: args.prompts]]
    engines = {}
    for name, tokens in (("graphs", most), ("eager", 0)):
        drafter = build_drafter(settings, models, 1, settings.max_seq_len)
        ks = [0, 3] if drafter is not None else [0]
        engines[name] = Engine(
            models.target, drafter, 1, settings.max_seq_len, ks, backend=backend, prefill_graph_tokens=tokens
        )
    for engine in engines.values():  # kernels and allocator warmed on a prompt not timed
        first_token_seconds(engine, prompts[0][:7], 2)
    times: dict[str, list[float]] = {name: [] for name in engines}
    prefilled = {"graph": 0, "eager": 0}  # the graphs engine's prompt tokens, by path
    served: dict[str, list[list[int]]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        for prompt in prompts:
            for name, engine in engines.items():
                seconds, out, result = first_token_seconds(engine, prompt, 32 if repeat == 0 else 1)
                times[name].append(seconds)
                if name == "graphs":
                    prefilled["graph" if result.prefill_graphed else "eager"] += result.prefill_tokens
                if repeat == 0:
                    served[name].append(out)
    graphs = engines["graphs"].prefill_graphs
    assert graphs is not None
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.repeats} repeats")
    print(f"drafter {settings.drafter}; prefill graphs: {len(graphs.buckets)} buckets up to {graphs.buckets[-1]}")
    print(f"capture {graphs.seconds:.2f} s, {graphs.memory_bytes / 2**20:.1f} MiB, {graphs.captures} graphs")
    for name, median in medians.items():
        print(f"  {name:6s} time to first token: median {median * 1e3:.2f} ms")
    print(f"graphs / eager: {medians['graphs'] / medians['eager']:.3f}x")
    share = prefilled["graph"] / sum(prefilled.values())
    print(f"prompt tokens through graphs: {share:.1%}; fallbacks {dict(graphs.fallbacks) or 'none'}")
    print(f"first 32 greedy tokens equal on every prompt: {served['graphs'] == served['eager']}")


if __name__ == "__main__":
    main()
