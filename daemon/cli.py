"""`adaspecd --config PATH` runs the daemon; `adaspecd --check-config PATH` only validates."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import anyio
import structlog

from control.issues import ConfigError
from control.load import load_config
from control.logs import configure_logging


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adaspecd", description="adaspec inference daemon")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--config", type=Path, help="run with this TOML config (hot-reloaded)")
    group.add_argument("--check-config", type=Path, metavar="PATH", help="validate a config file and exit")
    parser.add_argument(
        "--no-check-models",
        dest="check_models",
        action="store_false",
        help="with --check-config: skip checking that the model directories are in place",
    )
    args = parser.parse_args(argv)

    path: Path = args.check_config or args.config
    try:
        snapshot = load_config(path, check_models=args.check_models or not args.check_config)
    except ConfigError as err:
        print(f"adaspecd: {path}: {len(err.issues)} error(s)", file=sys.stderr)
        for issue in err.issues:
            print(f"  {issue}", file=sys.stderr)
        return 1
    if args.check_config:
        for warning in snapshot.warnings:
            print(f"adaspecd: {path}: warning: {warning}", file=sys.stderr)
        print(f"adaspecd: {path}: configuration is valid (sha256 {snapshot.sha256[:12]})")
        return 0

    configure_logging(snapshot.logging.level, snapshot.logging.format)
    for warning in snapshot.warnings:
        structlog.get_logger("adaspec.config").warning("config warning", warning=warning, config=str(path))
    # Until the daemon's own handlers take over, once its event loop runs: nothing is bound yet,
    # so a stop just ends the process, and a SIGHUP is caught up with once serving (the file's hash).
    signal.signal(signal.SIGTERM, _stop_before_start)
    signal.signal(signal.SIGINT, _stop_before_start)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from daemon.app import Daemon  # imports torch: keep --check-config fast

    return anyio.run(Daemon(path, snapshot).run)


def _stop_before_start(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
