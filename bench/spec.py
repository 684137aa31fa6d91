"""Run a workload against the engine in-process, once per mode, and compare them.

    python -m bench.spec --workload bench/workloads/transition.jsonl \\
        --modes none,static:1,static:3,static:7,adaptive:ema,adaptive:measured \\
        [--concurrency N] [--config FILE] [--json OUT] [--plot OUT.png]
    python -m bench.spec --workload bench/workloads/transition.jsonl --url http://127.0.0.1:8000 \\
        [--concurrency N] [--json OUT]

A workload is JSON Lines, one request per line: "prompt", "max_tokens", and optionally
"temperature", "top_p", "top_k", "seed", "stop", "phase" (a free label the report breaks results
down by), "arrival_s" (open loop: not submitted before that offset) and "concurrency" (closed loop:
sent once fewer than that many are in flight, so that a workload's load can swing; in-process
modes only). Without arrival times the run is closed-loop: --concurrency requests in flight (or a
line's own), the next one submitted as one finishes.

Modes: `none` (target only), `static:K` (a fixed k), `adaptive:positional`, `adaptive:measured`,
`adaptive:ema` (the config's [adaptive] parameters with that strategy, and that strategy's default
candidates where the config has the default; `+NAME=VALUE` overrides one more parameter or initial_k, as in
`adaptive:measured+exploration=0.01`); `+drafter=KIND`, `+verification=RULE`,
`+draft_quantization=int8|none`, `+threads=N` (the compiled forward pinned to N threads; 0 adapts),
`+eagle3=PATH` and `+dflash=PATH` (another EAGLE-3 head or DFlash drafter, to compare them on the
same target) change the engine's settings for that mode. Every mode
serves the same requests on the same loaded models in this process, side by side: the modes take
turns a round at a time, and each is timed by its own rounds, so a change in the machine's speed is
shared by all of them.
A round's wall time is shared among phases in proportion to the tokens each emitted in it, so
per-phase seconds add up to the total; the per-phase oracle serves each phase at the rate of that
phase's fastest static mode.

With --url the same workload goes through a running daemon's HTTP API (/v1/completions, one
client thread per request in flight) and the report has one row, "server": whatever the daemon
runs (restart it with another config to compare modes; bench/http_api.py does that). Tokens come
from each response's usage, accepted drafts from its "adaspec" field, rounds by k and switches
from /metrics. A phase's seconds are the wall time shared equally among the requests in flight
at each moment.
"""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import replace
from functools import cache, partial
from pathlib import Path

from bench.over_http import run_url
from bench.report import ModeReport, plot, print_table, write_reports
from bench.side_by_side import run_controllers, run_mode
from bench.workload import WorkItem, read_workload, widest
from control import assemble
from control.arguments import at_least
from control.assemble import Models, load_models
from control.issues import ConfigError
from control.load import load_config
from control.logs import configure_logging
from control.schema import DEFAULT_CANDIDATES
from control.snapshot import ConfigSnapshot
from engine.controller import Controller
from engine.device.resolve import DeviceError
from engine.model.config import DRAFT_QUANTIZATIONS, DRAFTERS, CheckpointError
from engine.model.dflash import DFlashModel, load_dflash
from engine.model.eagle3 import Eagle3Model, load_eagle3
from engine.model.transformer import Transformer
from engine.policy import PolicyParams
from engine.verify import CHAIN_RULES

ROOT = Path(__file__).resolve().parents[1]


def mode_snapshot(snapshot: ConfigSnapshot, mode: str) -> ConfigSnapshot:
    """The config a mode runs with: the daemon's, with drafting off (`none`), k fixed
    (`static:K`) or another strategy (`adaptive:NAME`), and any `+NAME=VALUE` overrides."""
    base, *overrides = mode.split("+")
    settings = dict(parse_override(o) for o in overrides)
    # The engine's own settings; every other override names a policy parameter.
    engine = replace(snapshot.engine, **{key: settings.pop(key) for key in ENGINE_OVERRIDES if key in settings})
    adaptive = snapshot.adaptive
    params = adaptive.policy
    if base == "none":
        engine = replace(engine, drafter="none")
    elif base.startswith("static:") and base[7:].isdigit() and not settings:
        k = int(base[7:])
        static = replace(params, candidate_k=(k,), slots=())
        adaptive = replace(adaptive, enabled=False, static_k=k, initial_k=k, policy=static)
    elif base.startswith("adaptive:") and base[9:] in DEFAULT_CANDIDATES:
        strategy = base[9:]
        if params.candidate_k == DEFAULT_CANDIDATES[params.strategy]:
            # The config left the candidates to its strategy: another strategy runs its own.
            settings.setdefault("candidate_k", DEFAULT_CANDIDATES[strategy])
        initial_k = settings.pop("initial_k", adaptive.initial_k)
        try:
            policy = replace(params, strategy=strategy, **settings)
        except ValueError as err:
            raise SystemExit(f"{mode!r}: {err}") from None
        adaptive = replace(adaptive, enabled=True, initial_k=initial_k, policy=policy)
    else:
        strategies = ", ".join(f"adaptive:{name}" for name in DEFAULT_CANDIDATES)
        raise SystemExit(f"unknown mode {mode!r}: none, static:K or {strategies}")
    return replace(snapshot, engine=engine, adaptive=adaptive)


def build_controller(
    mode: str, snapshot: ConfigSnapshot, models: Models, concurrency: int, max_seq_len: int
) -> Controller:
    """The engine a mode runs, assembled as the daemon assembles its own, `concurrency` slots wide."""
    settings = mode_snapshot(snapshot, mode)
    try:
        for kind in NAMED_DRAFTERS:  # +eagle3=PATH, +dflash=PATH: that drafter, on the loaded target
            path = getattr(settings.engine, kind)
            if path is not None and path != getattr(snapshot.engine, kind):
                models = replace(models, **{kind: named_drafter(kind, path, models.target.model)})
        return assemble.build_controller(settings, models, max_batch_size=concurrency, max_seq_len=max_seq_len)
    except (CheckpointError, ValueError) as err:  # a drafter not in place, a k no state can have
        raise SystemExit(f"mode {mode!r}: {err}") from None


# The drafters a mode may name by path, and how each loads on the target.
NAMED_DRAFTERS = {"eagle3": load_eagle3, "dflash": load_dflash}


@cache
def named_drafter(kind: str, path: Path, target: Transformer) -> Eagle3Model | DFlashModel:
    """The EAGLE-3 head or DFlash drafter a mode names, loaded once: every run of the mode shares
    it, as the config's drafters are shared (control.assemble.Models)."""
    return NAMED_DRAFTERS[kind](path, target)


ENGINE_OVERRIDES = ("verification", "drafter", "draft_quantization", "threads", *NAMED_DRAFTERS)


def drafters_of(modes: list[str]) -> set[str]:
    """The drafter kinds that modes name with +drafter=KIND (their models must be loaded)."""
    return {part.split("=", 1)[1] for mode in modes for part in mode.split("+")[1:] if part.startswith("drafter=")}


def parse_override(text: str) -> tuple[str, object]:
    """`name=value` of a policy parameter or of `initial_k`, as in adaptive:measured+exploration=0.01,
    or of the engine's `verification`, `drafter` or `draft_quantization` (any mode:
    static:3+verification=token); a list of step counts is written with slashes: candidate_k=0/3/7."""
    name, _, value = text.partition("=")
    if name == "verification" and value in CHAIN_RULES:
        return name, value
    if name == "threads" and value.isdigit():
        return name, int(value)
    if name == "drafter" and value in DRAFTERS:
        return name, value
    if name == "draft_quantization" and value in DRAFT_QUANTIZATIONS:
        return name, value
    if name in NAMED_DRAFTERS and value:
        return name, Path(value)
    if name not in (*PolicyParams.__dataclass_fields__, "initial_k") or not value:
        raise SystemExit(
            f"{text!r}: expected PARAMETER=VALUE with a policy parameter name, "
            f"verification={'|'.join(CHAIN_RULES)}, drafter={'|'.join(DRAFTERS)} "
            f"draft_quantization={'|'.join(DRAFT_QUANTIZATIONS)}, threads=N, eagle3=PATH or dflash=PATH"
        )
    if name == "candidate_k":
        try:
            return name, tuple(int(k) for k in value.split("/"))
        except ValueError:
            raise SystemExit(f"{text!r}: expected draft lengths separated by '/'") from None
    lowered = value.lower()
    if lowered in ("true", "false"):
        return name, lowered == "true"
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, value


def run_modes(
    modes: list[str],
    items: list[WorkItem],
    snapshot: ConfigSnapshot,
    models: Models,
    concurrency: int,
    max_seq_len: int,
    repeats: int = 1,
) -> dict[str, ModeReport]:
    """Serve `items` with every mode side by side, `repeats` times over, each time on new engines
    and with new seeds for sampled requests."""
    slots = widest(items, concurrency)
    factories = {mode: partial(build_controller, mode, snapshot, models, slots, max_seq_len) for mode in modes}
    return run_controllers(factories, items, models.target.tokenizer, concurrency, repeats)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--modes", default="none,static:1,static:3,static:7,adaptive:ema,adaptive:measured")
    parser.add_argument("--concurrency", type=at_least(1), default=1)
    parser.add_argument(
        "--config",
        type=Path,
        default=ROOT / "config.toml",
        help="TOML config: its [engine] and [adaptive] (the daemon's default)",
    )
    parser.add_argument("--target", default=None, help="target checkpoint (default: config, or models/target)")
    parser.add_argument("--draft", default=None, help="draft checkpoint (default: config, or models/draft)")
    parser.add_argument("--drafter", choices=DRAFTERS[:-1], default=None)
    parser.add_argument("--max-seq-len", type=at_least(2), default=1024)
    parser.add_argument(
        "--repeats",
        type=at_least(1),
        default=2,
        help="runs of all the modes side by side, each with new seeds for sampled requests; figures add up",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--url", default=None, help="a running daemon's HTTP API instead of in-process modes")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    for out in (args.json, args.plot):  # before the run, not after it
        if out is not None and not out.parent.is_dir():
            parser.error(f"{out}: no folder {out.parent} to write it in")

    items = read_workload(args.workload)
    if args.url:
        if args.plot:
            parser.error("--plot needs the in-process modes: the HTTP API reports no per-round timeline")
        print(f"workload {args.workload} ({len(items)} requests) through {args.url}, concurrency {args.concurrency}")
        import httpx

        try:
            reports = {"server": run_url(args.url, items, args.concurrency)}
        except httpx.TransportError as err:  # nothing listening there, a timeout, ...
            raise SystemExit(f"{parser.prog}: {args.url}: {err}") from None
        print_table(reports)
        if args.json:
            write_reports(args.json, reports)
        return

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        snapshot = bench_snapshot(args)
        models = load_models(snapshot, kinds=drafters_of(modes))
    except (ConfigError, CheckpointError, DeviceError) as err:
        raise SystemExit(f"{parser.prog}: {err}") from None
    print(
        f"workload {args.workload} ({len(items)} requests), concurrency {args.concurrency}, "
        f"drafter {snapshot.engine.drafter}, candidates {list(snapshot.adaptive.policy.candidate_k)}",
        file=sys.stderr,
    )
    warm_up(snapshot, models, items, args.concurrency, args.max_seq_len)
    reports = run_modes(modes, items, snapshot, models, args.concurrency, args.max_seq_len, args.repeats)
    print_table(reports)
    if args.json:
        write_reports(args.json, reports)
    if args.plot:
        plot(reports, args.plot, window=max(1.0, max(r.seconds for r in reports.values()) / 40))


def bench_snapshot(args: argparse.Namespace) -> ConfigSnapshot:
    """The config a bench runs (--config, by default the daemon's), with --target, --draft and
    --drafter over it, so that a bench measures what the daemon serves; logging is set up as the
    daemon sets it up, so that events below its level (the policy's own switches) are dropped, not
    written out in the middle of the rounds being timed."""
    snapshot = load_config(args.config)
    configure_logging(snapshot.logging.level, snapshot.logging.format, cache=False)
    engine = snapshot.engine
    if args.target is not None:
        engine = replace(engine, target=Path(args.target))
    if args.draft is not None:
        engine = replace(engine, draft=Path(args.draft))
    if args.drafter is not None:
        engine = replace(engine, drafter=args.drafter)
    return replace(snapshot, engine=engine)


def warm_up(
    snapshot: ConfigSnapshot, models: Models, items: list[WorkItem], concurrency: int, max_seq_len: int
) -> None:
    """Run the kernels once, so that the first mode is not charged for it, then freeze the
    collector's view of start-up's objects as the daemon does."""
    warm = build_controller("static:1", snapshot, models, concurrency, max_seq_len)
    run_mode(warm, items[:1], models.target.tokenizer, 1)
    gc.freeze()


if __name__ == "__main__":
    main()
