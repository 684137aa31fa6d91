"""Serving beside busy processes: tokens/s idle and with 1 and 2 single-threaded busy processes
beside the engine, each as a share of idle.

    python -m bench.contention [--target PATH] [--config FILE] [--modes MODES] \\
        [--workload FILE] [--requests 4] [--tokens 96] [--busy 0,1,2] [--repeats 2]

The bench starts the busy processes itself (`python -c "while True: pass"`, one core each at the
default priority, as a build or a backup would take) and kills them by pid after each condition.
Beside busy processes each mode serves the same requests alone, at batch 1, one mode after another
(taking turns a round at a time would leave one mode's idle threads spinning through another's
rounds); idle, where every mode runs on every core, the modes take turns a round at a time, as
bench.spec runs them, so that idle speeds compare within a percent. Conditions take turns
`--repeats` times, each repeat in another order, so that a drift of the machine's speed falls on
all alike. Each run is on a new
engine, but the policy that chooses its thread count carries over from condition to condition
(idle first) within a repeat, as in a daemon that stays up while other processes come and go. Modes are bench.spec's
(none, static:K, adaptive:NAME, with +NAME=VALUE overrides), `+threads=N` among them: the compiled
forward pinned to N threads (engine.threads). The default compares target-only and the config's policy, each with the
threads adapted (the shipped default) and pinned to every usable core (no adapting).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.report import ModeReport
from bench.side_by_side import ModeRun, run_side_by_side
from bench.spec import ROOT, bench_snapshot, build_controller, drafters_of, warm_up
from bench.workload import read_workload
from control.arguments import at_least
from control.assemble import load_models
from control.issues import ConfigError
from engine.device.resolve import DeviceError
from engine.model.config import CheckpointError
from engine.policy.threads import ThreadPolicy, usable_cores

BUSY = [sys.executable, "-c", "while True: pass"]


def busy_processes(count: int) -> list[subprocess.Popen[bytes]]:
    procs = [subprocess.Popen(BUSY) for _ in range(count)]
    time.sleep(0.5)  # let the scheduler place them before anything is timed
    return procs


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def main(argv: list[str] | None = None) -> None:
    cores = usable_cores()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "config.toml")
    parser.add_argument("--target", default=None, help="target checkpoint (default: the config's)")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--modes", default=None, help="default: none and the config's policy, adapted and pinned")
    parser.add_argument("--workload", type=Path, default=ROOT / "bench/workloads/suite/code-greedy.heldout.jsonl")
    parser.add_argument("--requests", type=at_least(1), default=4, help="the workload's first N requests")
    parser.add_argument("--tokens", type=at_least(1), default=96, help="max_tokens of each request")
    parser.add_argument("--busy", default="0,1,2", help="busy processes beside the engine, per condition")
    parser.add_argument("--repeats", type=at_least(1), default=2)
    parser.add_argument("--max-seq-len", type=at_least(2), default=1024)
    args = parser.parse_args(argv)
    busy = [int(b) for b in args.busy.split(",")]
    if 0 not in busy:
        parser.error("--busy must include 0: every share is of idle")

    items = [replace(i, params=replace(i.params, max_tokens=args.tokens)) for i in read_workload(args.workload)]
    items = items[: args.requests]
    try:
        snapshot = bench_snapshot(args)
        policy = f"adaptive:{snapshot.adaptive.policy.strategy}"
        default = ["none", f"none+threads={cores}", policy, f"{policy}+threads={cores}"]
        modes = args.modes.split(",") if args.modes else default
        models = load_models(snapshot, kinds=drafters_of(modes))
    except (ConfigError, CheckpointError, DeviceError) as err:
        raise SystemExit(f"{parser.prog}: {err}") from None
    print(f"{args.requests} requests x {args.tokens} tokens, batch 1, {cores} usable cores", file=sys.stderr)
    warm_up(snapshot, models, items, 1, args.max_seq_len)
    reports: dict[int, dict[str, ModeReport]] = {b: {m: ModeReport() for m in modes} for b in busy}
    for repeat in range(args.repeats):
        threads: dict[str, ThreadPolicy | None] = {}
        for count in busy:
            procs = busy_processes(count)
            try:
                order = modes[repeat % len(modes) :] + modes[: repeat % len(modes)]
                runs = {}
                for mode in order if repeat % 2 == 0 else order[::-1]:
                    # A new engine for each condition, so that no request is served faster for
                    # having been served before (lookups of finished requests, a warm policy);
                    # but the thread count's policy is the one that served the previous condition,
                    # as in a daemon that stays up while other processes come and go.
                    controller = build_controller(mode, snapshot, models, 1, args.max_seq_len)
                    if mode in threads:
                        controller.threads = threads[mode]
                    threads[mode] = controller.threads
                    runs[mode] = ModeRun(controller, items, models.target.tokenizer, 1)
                    if count:  # one after another: see above
                        run_side_by_side([runs[mode]])
                if not count:  # idle, every mode on every core: side by side, as bench.spec
                    run_side_by_side(list(runs.values()))
            finally:
                stop(procs)
            for mode, run in runs.items():
                reports[count][mode].merge(run.report)
                rate = run.report.tokens / run.report.seconds
                print(f"  run {repeat + 1}, {count} busy, {mode}: {rate:.1f} tok/s", file=sys.stderr)
    print_shares(reports, modes)


def print_shares(reports: dict[int, dict[str, ModeReport]], modes: list[str]) -> None:
    counts = sorted(reports)
    width = max(len(m) for m in modes)
    print(f"{'mode':<{width}}  " + "  ".join(f"{f'{c} busy':>18}" for c in counts))
    for mode in modes:
        idle = reports[0][mode]
        idle_rate = idle.tokens / idle.seconds
        cells = []
        for c in counts:
            r = reports[c][mode]
            rate = r.tokens / r.seconds
            cells.append(f"{rate:8.1f} tok/s {rate / idle_rate:4.0%}")
        print(f"{mode:<{width}}  " + "  ".join(f"{cell:>18}" for cell in cells))


if __name__ == "__main__":
    main()
