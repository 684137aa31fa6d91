"""How much could any step policy gain on a workload, at batch 1?

    python -m bench.headroom --workload bench/workloads/transition.jsonl [--max-k 12] [--passes 20]

Each request is decoded by the target alone (its seed, or its line number when it has none); the
draft then reads the same text, and each position gets the chance that a draft there is kept:
for greedy requests 1 when the draft's argmax is the target's token, else 0; for sampled ones
1 - TV(p, q), the rejection-sampling acceptance of the draft's distribution q against the
target's p (both after the request's temperature, top-k and top-p). A round's cost is measured
with the engine for every k (draft plus verify, one request of each phase). Kept drafts are drawn
from those chances (`--passes` times) and four ways of choosing k are replayed on the same draws:

- the best static k, for the whole workload and for each phase (the per-phase oracle);
- `knows the odds`: a policy told each position's chance before drafting it, which drafts while
  the chance that every draft so far is kept stays above a threshold (the best one is reported):
  the ceiling for any policy that predicts acceptance, however well;
- `clairvoyant`: drafts exactly the drafts that will be kept, a bound no policy reaches (it
  would have to know the target's verdict, or on sampled text the dice, before drafting).

It bounds what adapting k can win: on the default pair the sampled phase's chances barely vary,
so even knowing them beats the best static k by little there.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path

import torch

from bench.report import ModeReport, per_phase_oracle, phase_rate
from bench.workload import WorkItem, read_workload
from control.arguments import at_least
from engine.checkpoint import Checkpoint, load_checkpoint
from engine.core import Engine
from engine.drafters.draft_model import DraftModelDrafter, int8_linears
from engine.generate import generate
from engine.model.transformer import Transformer
from engine.request import Request
from engine.sampling import target_probs

# Chooses k for a round that starts at position `at`, from each position's chance that its draft
# is kept (and, for the clairvoyant alone, from whether it will be).
Chooser = Callable[[Seq[float], Seq[bool], int], int]


@torch.inference_mode()
def keep_chances(target: Checkpoint, draft: Transformer, items: Seq[WorkItem]) -> list[list[float]]:
    """Per request, the chance that a draft of `draft` at each output position is kept."""
    chances = []
    for line, item in enumerate(items):
        params = item.params if item.params.seed is not None else replace(item.params, seed=line)
        prompt = target.tokenizer.encode(item.prompt).ids
        output = generate(target, [prompt], params)[0].tokens
        text = torch.tensor([prompt + output])
        first = len(prompt) - 1  # the logits that predict the first output token
        p_logits = target.model.forward_train(text)[0, first : first + len(output)].float()
        q_logits = draft.forward_train(text)[0, first : first + len(output)].float()
        if params.greedy:
            chances.append((q_logits.argmax(-1) == torch.tensor(output)).float().tolist())
        else:
            p = torch.stack([target_probs(row, params) for row in p_logits])
            q = torch.stack([target_probs(row, params) for row in q_logits])
            chances.append(torch.minimum(p, q).sum(-1).tolist())
    return chances


def round_seconds(target: Checkpoint, draft: Checkpoint, item: WorkItem, max_k: int, tokens: int = 96) -> list[float]:
    """Seconds of a round with k drafts at batch 1, k = 0..max_k: the median round of a
    request decoded with the engine (after one to warm its shapes), since single rounds are noisy."""
    prompt = tuple(target.tokenizer.encode(item.prompt).ids)
    params = replace(item.params, max_tokens=tokens, ignore_eos=True, seed=0)
    max_seq_len = len(prompt) + tokens + 1
    seconds = []
    for k in range(max_k + 1):
        drafter = DraftModelDrafter(draft, 1, max_seq_len, quantize=True)
        engine = Engine(target, drafter, 1, max_seq_len, [k], max_k=max_k)
        engine.run_until_done([Request(prompt, params)])
        engine.add_request(Request(prompt, params))
        rounds = []
        while engine.has_work:
            step = engine.step(k)
            if step.batch_size:
                rounds.append(step.draft_seconds + step.verify_seconds)
        seconds.append(statistics.median(rounds[1:] or rounds))  # the first round follows the prefill
    return seconds


def replay(kept: Seq[bool], chances: Seq[float], cost: Seq[float], choose: Chooser) -> tuple[int, float]:
    """Tokens and seconds of decoding one request whose drafts are kept as `kept` says."""
    tokens, seconds, at = 0, 0.0, 0
    while at < len(kept):
        k = min(choose(chances, kept, at), len(kept) - at - 1, len(cost) - 1)
        run = 0
        while run < k and kept[at + run]:
            run += 1
        tokens += run + 1  # the kept drafts and the target's own token
        seconds += cost[k]
        at += run + 1
    return tokens, seconds


def static(k: int) -> Chooser:
    return lambda chances, kept, at: k


def knows_the_odds(threshold: float, max_k: int) -> Chooser:
    def choose(chances: Seq[float], kept: Seq[bool], at: int) -> int:
        survive, k = 1.0, 0
        for chance in chances[at : at + max_k]:
            survive *= chance
            if survive < threshold:
                break
            k += 1
        return k

    return choose


def clairvoyant(max_k: int) -> Chooser:
    """Drafts exactly the drafts that will be kept: none is wasted, and the round ends on the
    target's own token."""

    def choose(chances: Seq[float], kept: Seq[bool], at: int) -> int:
        k = 0
        while k < max_k and at + k < len(kept) and kept[at + k]:
            k += 1
        return k

    return choose


def main(argv: Seq[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--target", default="models/target")
    parser.add_argument("--draft", default="models/draft")
    parser.add_argument("--max-k", type=int, default=12)
    parser.add_argument("--passes", type=at_least(1), default=20, help="draws of the kept drafts per request")
    args = parser.parse_args(argv)

    items = read_workload(args.workload)
    target, draft = load_checkpoint(args.target), load_checkpoint(args.draft)
    chances = keep_chances(target, int8_linears(draft.model), items)  # as the engine drafts on CPU
    phases = sorted({item.phase for item in items})
    costs = {
        phase: round_seconds(target, draft, next(i for i in items if i.phase == phase), args.max_k) for phase in phases
    }
    for phase in phases:
        shown = ", ".join(f"k={k} {1e3 * s:.2f}" for k, s in enumerate(costs[phase]))
        print(f"round ms ({phase}): {shown}")

    rng = random.Random(0)
    draws = [[[rng.random() < c for c in request] for _ in range(args.passes)] for request in chances]
    choosers: dict[str, Chooser] = {f"static:{k}": static(k) for k in range(args.max_k + 1)}
    for threshold in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        choosers[f"knows the odds >= {threshold}"] = knows_the_odds(threshold, args.max_k)
    choosers["clairvoyant"] = clairvoyant(args.max_k)
    reports = {name: ModeReport() for name in choosers}
    for item, request, request_draws in zip(items, chances, draws):
        for kept in request_draws:
            for name, choose in choosers.items():
                tokens, seconds = replay(kept, request, costs[item.phase], choose)
                report = reports[name]
                report.tokens += tokens
                report.seconds += seconds
                report.phase_tokens[item.phase] += tokens
                report.phase_seconds[item.phase] += seconds

    def rate(name: str) -> float:
        return reports[name].tokens / reports[name].seconds

    statics = {name: r for name, r in reports.items() if name.startswith("static:")}
    odds = [name for name in choosers if name.startswith("knows")]
    best = max(statics, key=rate)
    oracle, fastest = per_phase_oracle(statics, phases)
    print(f"\n{'phase':>10} {'best static':>14} {'tok/s':>8} {'knows the odds':>16} {'clairvoyant':>12}")
    for phase in phases:
        best_here = phase_rate(reports[fastest[phase]], phase)
        best_odds = max(phase_rate(reports[name], phase) for name in odds)
        print(
            f"{phase:>10} {fastest[phase]:>14} {best_here:>8.1f} {best_odds / best_here:>15.3f}x "
            f"{phase_rate(reports['clairvoyant'], phase) / best_here:>11.3f}x"
        )
    best_odds = max(odds, key=rate)
    print(f"\noverall: best static {best} {rate(best):.1f} tok/s")
    print(f"  per-phase oracle   {oracle / rate(best):.3f}x")
    print(f"  knows the odds     {rate(best_odds) / rate(best):.3f}x ({best_odds})")
    print(f"  clairvoyant        {rate('clairvoyant') / rate(best):.3f}x")


if __name__ == "__main__":
    main()
