"""Resident memory of a loaded checkpoint against its file's size: the process's VmRSS before
the load (the interpreter, torch and the compiled kernels already in) and after it, and its
anonymous part (RssAnon: the model's own memory, without the pages of shared libraries that the
load's code first touched).

    python -m bench.memory PATH [--weights int8|int4] [--operators] [--json]

A GGUF served by the compiled forward keeps its quantized matrices only as the kernels' panels
(engine/checkpoint.py); --operators loads it as every other device does, dequantized to float32.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

from engine.checkpoint import load_checkpoint
from engine.native.build import library


def resident_bytes() -> dict[str, int]:
    """This process's resident memory (VmRSS), and its anonymous part (RssAnon: what it holds
    privately, not the pages of files and shared libraries it maps), in bytes."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            found[key] = int(value.split()[0]) * 1024
    if len(found) != 2:
        raise RuntimeError("no VmRSS or RssAnon in /proc/self/status")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--weights", default="as_loaded", choices=("as_loaded", "int8", "int4"))
    parser.add_argument("--operators", action="store_true", help="no compiled forward: float32, as on accelerators")
    parser.add_argument("--json", action="store_true", help="one JSON line")
    args = parser.parse_args()

    library()  # built and mapped before the first measurement: it is not the model's
    before = resident_bytes()
    checkpoint = load_checkpoint(args.path, weights=args.weights, native_forward=not args.operators)
    gc.collect()
    after = resident_bytes()
    native = checkpoint.model.native
    files = [args.path] if args.path.is_file() else list(args.path.glob("*.safetensors"))
    measured = {
        "file_bytes": sum(f.stat().st_size for f in files),
        "rss_before": before["VmRSS"],
        "rss_after": after["VmRSS"],
        "loaded_bytes": after["VmRSS"] - before["VmRSS"],
        "loaded_private_bytes": after["RssAnon"] - before["RssAnon"],
        "weight_bytes": native.weight_bytes if native is not None else None,
    }
    if args.json:
        print(json.dumps(measured))
        return
    mb = 1e6
    print(f"{args.path}: file {measured['file_bytes'] / mb:.1f} MB")
    size = measured["file_bytes"]
    print(f"  resident before load {before['VmRSS'] / mb:.1f} MB, after {after['VmRSS'] / mb:.1f} MB")
    for what, key in (("resident memory", "loaded_bytes"), ("private (anonymous) memory", "loaded_private_bytes")):
        print(f"  the load added {measured[key] / mb:.1f} MB of {what}: {measured[key] / size:.2f}x the file")
    if native is not None:
        print(f"  weights the compiled forward reads: {native.weight_bytes / mb:.1f} MB")


if __name__ == "__main__":
    main()
