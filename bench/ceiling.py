"""What would a drafter that is never wrong serve on this machine? The ceiling for any drafter.

    python -m bench.ceiling --workload bench/workloads/suite/code-greedy.heldout.jsonl \\
        [--ks 1,3,5,7] [--modes none,static:3+drafter=dflash] [--paying eagle3,dflash] [--repeats 3]

Every request (greedy only) is first decoded by the target alone. `oracle:K` then serves it with
a drafter that proposes the next K tokens of that very output, at no cost of its own: every
draft is kept, so a round emits K + 1 tokens for the price of the target's verify and the
round's own work. It runs side by side with `--modes` (bench.spec's modes), a round at a time,
so its tokens per second over target-only (`none`) bound what any drafter could reach here at
that k, prefill included: a bar above it cannot be met by a better drafter, only by a cheaper
target forward.

With --paying KIND, `oracle:K+paying=KIND` is the same oracle paying for a real drafter of that
kind (the config's checkpoint) as it drafts: the drafter is admitted, drafts K tokens a round with
no confidence cut, and is told what was kept, as when it serves, but the oracle's tokens are
verified. That bounds what any drafter of that shape and cost could reach, however well trained.

With --copies, `copies:K` drafts only what a copy of the context could get right: at each round,
of the target's next K tokens, as many as some run of tokens already in the prompt or the output
matches, whichever earlier position matches longest. That bounds every prompt-lookup drafter (the
n-gram drafter, llama.cpp's lookup), whatever its rule for choosing where to copy from, at no cost.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence as Seq
from functools import partial

from torch import Tensor

from bench.report import print_table, write_reports
from bench.side_by_side import run_controllers
from bench.spec import bench_snapshot, build_controller, drafters_of, mode_snapshot, warm_up
from bench.spec import make_parser as spec_parser
from bench.workload import WorkItem, read_workload
from control.arguments import integers
from control.assemble import Models, build_drafter, load_models
from control.snapshot import ConfigSnapshot
from engine.confidence import EVERY_DRAFT, ConfidenceRule
from engine.controller import Controller
from engine.core import Engine
from engine.drafters.base import Drafter, Proposal
from engine.generate import generate
from engine.model.config import DRAFTERS
from engine.request import Sequence


class OracleDrafter(Drafter):
    """Proposes the target's own greedy output, known in advance: a bench's ceiling, never a
    drafter to serve with (it has to have decoded the request already). With `paying`, a real
    drafter does all its work beside it (its proposals dropped), so the round costs what it would."""

    name = "oracle"

    def __init__(
        self,
        outputs: dict[tuple[int, ...], list[int]],
        paying: Drafter | None = None,
        reach: dict[tuple[int, ...], list[int]] | None = None,
    ) -> None:
        self.outputs = outputs
        self.paying = paying
        self.reach = reach  # where set, how many drafts at each point of an output it may propose
        self.capture_layers: tuple[int, ...] = paying.capture_layers if paying is not None else ()

    def admit(self, seqs: Seq[Sequence], hidden: dict[int, Tensor]) -> None:
        if self.paying is not None:
            self.paying.admit(seqs, hidden)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int], rule: ConfidenceRule = EVERY_DRAFT) -> list[Proposal]:
        if self.paying is not None:
            self.paying.propose(seqs, ks, EVERY_DRAFT)
        proposals = []
        for seq, k in zip(seqs, ks):
            done, prompt = len(seq.output), seq.request.prompt
            most = k if self.reach is None else min(k, self.reach[prompt][done])
            proposals.append(Proposal(self.outputs[prompt][done : done + most]))
        return proposals

    def accept(self, seqs: Seq[Sequence], accepted: Seq[int], hidden: dict[int, Tensor]) -> None:
        if self.paying is not None:
            self.paying.accept(seqs, accepted, hidden)

    def release(self, seq: Sequence) -> None:
        if self.paying is not None:
            self.paying.release(seq)


def target_outputs(models: Models, items: Seq[WorkItem]) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy output from the target alone (the longest, where a prompt comes twice
    with other max_tokens: the shorter is its beginning)."""
    target = models.target
    outputs: dict[tuple[int, ...], list[int]] = {}
    for item in items:
        prompt = tuple(target.tokenizer.encode(item.prompt).ids)
        output = generate(target, [list(prompt)], item.params)[0].tokens
        outputs[prompt] = max(outputs.get(prompt, []), output, key=len)
    return outputs


def copyable(prompt: Seq[int], output: Seq[int], most: int) -> list[int]:
    """At each point d of `output`, how many of its next tokens (up to `most`) a copy of tokens
    already there (the prompt and output[:d]) gets right, from the earlier position that matches
    longest."""
    text, reach = [*prompt, *output], []
    for done in range(len(output)):
        end, want = len(prompt) + done, output[done : done + most]
        best = 0
        for start in range(end):
            n = 0
            while n < len(want) and start + n < end and text[start + n] == want[n]:
                n += 1
            best = max(best, n)
            if best == len(want):
                break
        reach.append(best)
    return reach


def oracle_controller(
    k: int,
    outputs: dict[tuple[int, ...], list[int]],
    snapshot: ConfigSnapshot,
    models: Models,
    max_seq_len: int,
    paying: str | None = None,
    reach: dict[tuple[int, ...], list[int]] | None = None,
) -> Controller:
    """A static-k engine (batch 1) whose drafter is the oracle, paying for a drafter of kind
    `paying` if one is named, drafting only what a copy gets right where `reach` says it; its
    policy that of `static:K`."""
    drafter = None
    if paying is not None:
        drafter = build_drafter(mode_snapshot(snapshot, f"static:{k}+drafter={paying}").engine, models, 1, max_seq_len)
    engine = Engine(
        models.target,
        OracleDrafter(outputs, drafter, reach),
        1,
        max_seq_len,
        [k],
        max_k=max(k, snapshot.engine.max_k),
        verification=snapshot.engine.verification,
    )
    static = mode_snapshot(snapshot, f"static:{k}").adaptive
    return Controller(engine, static.policy, adaptive=False, static_k=k, initial_k=k)


def drafter_kinds(text: str) -> list[str]:
    """A comma-separated list of drafter kinds (`none` is no drafter)."""
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    known = [kind for kind in DRAFTERS if kind != "none"]
    for kind in kinds:
        if kind not in known:
            raise argparse.ArgumentTypeError(f"{kind!r} is not a drafter ({', '.join(known)})")
    return kinds


def make_parser() -> argparse.ArgumentParser:
    parser = spec_parser()
    parser.description = __doc__
    parser.set_defaults(modes="none", repeats=3)
    parser.add_argument(
        "--ks", type=integers(1, 64), default=[1, 3, 5, 7], help="the oracle's draft lengths, comma-separated"
    )
    parser.add_argument(
        "--paying",
        type=drafter_kinds,
        default=[],
        help="drafter kinds whose work the oracle also pays for (oracle:K+paying=KIND), comma-separated",
    )
    parser.add_argument(
        "--copies", action="store_true", help="also copies:K, the oracle drafting only what a copy gets right"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    items = read_workload(args.workload)
    if any(not item.params.greedy for item in items):
        parser.error("the oracle knows greedy outputs only: the workload has sampled requests")
    if args.url or args.concurrency != 1:
        parser.error("the ceiling runs in-process at batch 1")
    if args.plot:
        parser.error("--plot is bench.spec's: the ceiling prints its ratios only")
    snapshot = bench_snapshot(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    ks = args.ks
    models = load_models(snapshot, kinds=drafters_of(modes) | set(args.paying))
    outputs = target_outputs(models, items)
    warm_up(snapshot, models, items, 1, args.max_seq_len)
    factories = {m: partial(build_controller, m, snapshot, models, 1, args.max_seq_len) for m in modes}
    for k in ks:
        factories[f"oracle:{k}"] = partial(oracle_controller, k, outputs, snapshot, models, args.max_seq_len)
        for kind in args.paying:
            factories[f"oracle:{k}+paying={kind}"] = partial(
                oracle_controller, k, outputs, snapshot, models, args.max_seq_len, kind
            )
    if args.copies:
        most = max(ks)
        reach = {prompt: copyable(prompt, output, most) for prompt, output in outputs.items()}
        for k in ks:
            factories[f"copies:{k}"] = partial(
                oracle_controller, k, outputs, snapshot, models, args.max_seq_len, None, reach
            )
    reports = run_controllers(factories, items, models.target.tokenizer, 1, args.repeats)
    print_table(reports)
    if "none" in reports:
        base = reports["none"]
        for name, oracle in reports.items():
            if not name.startswith(("oracle:", "copies:")):
                continue
            ratio = (oracle.tokens / oracle.seconds) / (base.tokens / base.seconds)
            runs = ", ".join(f"{a / b:.2f}" for a, b in zip(oracle.runs, base.runs))
            print(f"ceiling of {name}: {ratio:.2f}x none (runs {runs})")
    if args.json:
        write_reports(args.json, reports)


if __name__ == "__main__":
    main()
