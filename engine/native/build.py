"""engine/native/kernels.c compiled once per machine and source, and loaded.

The library is built with the system's C compiler on first use and kept in the cache directory
(`$ADASPEC_CACHE_DIR`, else `$XDG_CACHE_HOME/adaspec`, else `~/.cache/adaspec`), keyed by the
source, its header, the compiler and the CPU. Where no compiler works, or `ADASPEC_NATIVE=0`,
models run on the PyTorch operators instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from engine.native.abi import HEADER, declare

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


def cache_dir() -> Path:
    if os.environ.get("ADASPEC_CACHE_DIR"):
        return Path(os.environ["ADASPEC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaspec"


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))


_lock = threading.Lock()

_library: ctypes.CDLL | None = None

_problem: str | None = None


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (and `problem()` says why) where they cannot be."""
    global _library, _problem
    with _lock:
        if _library is not None or _problem is not None:
            return _library
        if os.environ.get("ADASPEC_NATIVE", "1") == "0":
            _problem = "disabled by ADASPEC_NATIVE=0"
            return None
        try:
            _library = _load(_build())
        except (OSError, subprocess.SubprocessError, RuntimeError) as err:
            _problem = str(err)
            log.warning("the compiled CPU kernels are unavailable (%s); using PyTorch operators", err)
        return _library


def problem() -> str | None:
    """Why `library()` is None, once it has been asked for."""
    return _problem


def pending_build() -> str | None:
    """What a first `library()` call will compile ("COMPILER -> LIBRARY"), where it will; None where
    the library is loaded or cached already, or cannot be built (`library()` then says why)."""
    if _library is not None or _problem is not None or os.environ.get("ADASPEC_NATIVE", "1") == "0":
        return None
    try:
        compiler, target = _compiler_and_target(SOURCE)
    except RuntimeError:
        return None
    return None if target.exists() else f"{compiler} -> {target}"


def _compiler_and_target(source: Path) -> tuple[str, Path]:
    """The C compiler, and the cached library compiled from `source`, keyed by its text, the
    header's, the compiler and the CPU."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(f"the C compiler {compiler!r} does not run ({err})") from None
    key = hashlib.sha256(
        "\0".join([source.read_text(), HEADER.read_text(), version, " ".join(FLAGS), _cpu_signature()]).encode()
    )
    return compiler, cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"


def _build(source: Path = SOURCE) -> Path:
    """The kernels compiled from `source`, or the cached library."""
    compiler, target = _compiler_and_target(source)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Said before it starts: on a first start the compiler runs for seconds inside a model's load.
    log.info("compiling the CPU kernels (once per machine and source): %s -> %s", compiler, target)
    # Built beside its final name and renamed into place: a concurrent build never sees half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, "-I", str(HEADER.parent), "-o", partial, str(source), "-lm"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name}: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and library() is not None


def _load(path: Path) -> ctypes.CDLL:
    # torch has loaded its libgomp already: the kernels link to the same one and share its threads.
    return declare(ctypes.CDLL(str(path)))
