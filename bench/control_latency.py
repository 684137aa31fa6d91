"""How fast the control plane acts on a running daemon that is busy decoding.

    python -m bench.control_latency [--repeats 5]

Starts the daemon on the default models with one long request decoding, then measures:
- saved edit -> applied: an [adaptive] edit written in place, until `adaspecctl status` shows
  the new generation (the engine has taken the new parameters at a boundary by then);
- pin -> effect: `adaspecctl pin K` until its reply, which comes once the engine has applied it,
  in milliseconds and in rounds (the round of the reply minus the round just before the pin).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import httpx

from bench.http_api import RunningDaemon, daemon
from bench.spec import ROOT


def ctl(running: RunningDaemon, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "control.ctl", "--socket", str(running.socket), "--json", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    return json.loads(done.stdout)


def keep_busy(url: str, stop: threading.Event) -> None:
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            client.post(
                f"{url}/v1/completions",
                json={"prompt": "import os\n", "max_tokens": 1500, "temperature": 0, "ignore_eos": True},
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    with daemon('strategy = "ema"\nema_alpha = 0.2', max_batch_size=4) as running:
        stop = threading.Event()
        busy = threading.Thread(target=keep_busy, args=(running.url, stop), daemon=True)
        busy.start()
        time.sleep(2.0)  # decoding is under way
        edits, pins, pin_rounds = [], [], []
        for i in range(args.repeats):
            generation = ctl(running, "status")["generation"]
            text = running.config.read_text()
            alpha = "0.2" if i % 2 else "0.3"
            old = "0.3" if i % 2 else "0.2"
            started = time.perf_counter()
            running.config.write_text(text.replace(f"ema_alpha = {old}", f"ema_alpha = {alpha}"))
            while ctl(running, "status")["generation"] == generation:
                time.sleep(0.005)
            edits.append(time.perf_counter() - started)

            before = ctl(running, "status")["round"]
            started = time.perf_counter()
            reply = ctl(running, "pin", str(1 if i % 2 else 3))
            pins.append(time.perf_counter() - started)
            pin_rounds.append(reply["round"] - before)
            ctl(running, "unpin")
        stop.set()
        status = ctl(running, "status")

    def summary(values: list[float]) -> str:
        return f"median {statistics.median(values) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms"

    print(f"decoding at {status['tokens_per_s']:.0f} tokens/s while measuring ({args.repeats} repeats)")
    print(f"saved edit -> applied (status shows the new generation): {summary(edits)}")
    print(f"pin -> applied (adaspecctl round trip, incl. process start): {summary(pins)}")
    print(f"pin -> applied in rounds after the last observed round: {pin_rounds}")


if __name__ == "__main__":
    main()
