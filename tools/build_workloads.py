"""Build the benchmark suite (bench/workloads/suite/) from text the default models never saw.

    python tools/build_workloads.py [--out bench/workloads/suite] [--requests 24] [--max-tokens 96]

The default models learnt the CPython standard library outside its tests (models/README.md). The
suite is cut from the code and docstrings of third-party packages installed beside adaspec, and
from the standard library's tests, none of which they saw. Every kind of workload is written
twice from disjoint packages: NAME.tune.jsonl, the half rules and defaults may be chosen on, and
NAME.heldout.jsonl, the half they are judged on. The packages of each half are listed below and in
bench/workloads/README.md; the files are committed, so the suite does not change with what is
installed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
from collections.abc import Callable
from pathlib import Path

HALVES = {
    "tune": ("starlette", "anyio", "httpx", "jinja2", "click", "packaging", "pygments"),
    "heldout": ("uvicorn", "structlog", "watchfiles", "prometheus_client", "h11", "markdown_it", "pyparsing"),
}
NOISE = "🙂🚀✨🔥💡🎉🌈⚡️🍕🐍🦀📦🧪🔧📈🎲🪐🧭🫧🌀"


def package_files(names: tuple[str, ...]) -> list[Path]:
    files = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise SystemExit(f"package {name!r} is not installed: pip install -e '.[dev]' first")
        files += sorted(p for p in Path(spec.origin).parent.rglob("*.py") if "test" not in p.parts)
    return files


def functions(files: list[Path]) -> list[tuple[str, ast.FunctionDef]]:
    """Every function of at least 6 lines, with its file's text."""
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 6:
                found.append((text, node))
    return found


def before(text: str, line: int, max_chars: int = 1200) -> str:
    """The file up to and including line `line` (1-based), at most max_chars, from a line start."""
    head = "".join(text.splitlines(keepends=True)[:line])[-max_chars:]
    return head[head.index("\n") + 1 :] if "\n" in head[:-1] else head


def code(rng: random.Random, funcs, **params) -> dict:
    """A file up to a function's signature: what comes next is its body."""
    text, node = rng.choice(funcs)
    return {"prompt": before(text, node.body[0].lineno - 1), **params}


def docstring(rng: random.Random, funcs, **params) -> dict:
    """A file up to a function's signature and the opening quotes of its docstring: prose next."""
    while True:
        text, node = rng.choice(funcs)
        if ast.get_docstring(node):
            indent = " " * node.body[0].col_offset
            return {"prompt": before(text, node.body[0].lineno - 1) + f'{indent}"""', **params}


def repeat(rng: random.Random, funcs, **params) -> dict:
    """A function, then its signature again: the model will write much of it again (lookup-heavy)."""
    text, node = rng.choice(funcs)
    lines = text.splitlines(keepends=True)
    body = "".join(lines[node.lineno - 1 : node.end_lineno])[:1500]
    return {"prompt": body + "\n\n" + "".join(lines[node.lineno - 1 : node.body[0].lineno - 1]), **params}


def noise(rng: random.Random, _funcs, **params) -> dict:
    """Emoji and scattered words: no model predicts what follows."""
    words = ["".join(rng.choices(NOISE, k=rng.randint(1, 4))) for _ in range(40)]
    return {"prompt": " ".join(words), **params}


Maker = Callable[..., dict]
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
PROSE = {"temperature": 1.0}


def phases(*parts: tuple[str, Maker, dict, int]):
    """Requests phase after phase: (label, maker, sampling, count)."""

    def build(rng: random.Random, funcs, requests: int) -> list[dict]:
        out = []
        for label, make, sampling, share in parts:
            out += [{**make(rng, funcs, **sampling), "phase": label} for _ in range(requests * share // 8)]
        return out

    return build


KINDS = {
    "code-greedy": phases(("code", code, GREEDY, 8)),
    "code-sampled": phases(("code", code, SAMPLED, 8)),
    "docstrings-t1": phases(("prose", docstring, PROSE, 8)),
    "lookup": phases(("repeat", repeat, GREEDY, 6), ("code", code, GREEDY, 2)),
    # SGLang's shape: low, high, low, high acceptance, a quarter each.
    "transition": phases(
        ("low", docstring, PROSE, 2),
        ("high", repeat, GREEDY, 2),
        ("low", docstring, PROSE, 2),
        ("high", repeat, GREEDY, 2),
    ),
    "hopeless-mix": phases(
        ("noise", noise, PROSE, 2), ("code", code, GREEDY, 2), ("noise", noise, PROSE, 2), ("code", code, GREEDY, 2)
    ),
    "mixed": phases(("code", code, GREEDY, 3), ("sampled", code, SAMPLED, 3), ("prose", docstring, PROSE, 2)),
}


def interleaved(*parts: tuple[str, Maker, dict]):
    """Requests of each part in turn, one at a time: every batch holds some of each."""

    def build(rng: random.Random, funcs, requests: int) -> list[dict]:
        return [
            {**make(rng, funcs, **sampling), "phase": label}
            for label, make, sampling in (parts[i % len(parts)] for i in range(requests))
        ]

    return build


def swings(quiet: int = 1, busy: int = 8):
    """Greedy code, closed loop, its load alternating: a sixth of the requests at concurrency
    `quiet`, a third at `busy`, twice over (where drafting pays alone, it may lose in a full batch)."""

    def build(rng: random.Random, funcs, requests: int) -> list[dict]:
        out = []
        for label, concurrency, share in (("quiet", quiet, 1), ("busy", busy, 2)) * 2:
            out += [
                {**code(rng, funcs, **GREEDY), "phase": label, "concurrency": concurrency}
                for _ in range(requests * share // 6)
            ]
        return out

    return build


# Traffic one k cannot fit (bench/workloads/moving/): greedy code, sampled prose and lookups in
# one batch; a load that swings. Written after the suite's kinds, which keep their seeds.
MOVING = {
    "interleaved": interleaved(("code", code, GREEDY), ("prose", docstring, SAMPLED), ("repeat", repeat, GREEDY)),
    "swings": swings(),
}


def with_bursts(items: list[dict], rng: random.Random, every_s: float = 1.5, size: int = 6) -> list[dict]:
    """Open loop: requests arrive `size` at a time every `every_s` seconds, so the batch moves."""
    rng.shuffle(items)
    return [{**item, "arrival_s": round((i // size) * every_s, 3)} for i, item in enumerate(items)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/workloads/suite"))
    parser.add_argument(
        "--moving-out", type=Path, default=Path("bench/workloads/moving"), help="where the kinds of moving traffic go"
    )
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    for flag, value in (("--requests", args.requests), ("--max-tokens", args.max_tokens)):
        if value < 1:  # the files would be empty, or requests the benches refuse
            parser.error(f"{flag} must be at least 1, not {value}")
    folders = {kind: args.out for kind in [*KINDS, "bursts"]} | dict.fromkeys(MOVING, args.moving_out)
    for folder in set(folders.values()):
        folder.mkdir(parents=True, exist_ok=True)
    for half, packages in HALVES.items():
        funcs = functions(package_files(packages))
        for number, (kind, build) in enumerate({**KINDS, "bursts": KINDS["mixed"], **MOVING}.items()):
            rng = random.Random(f"{half}/{kind}")
            items = build(rng, funcs, args.requests)
            if kind == "bursts":
                items = with_bursts(items, rng)
            lines = [
                json.dumps({**item, "max_tokens": args.max_tokens, "seed": 1000 * number + i}, ensure_ascii=False)
                for i, item in enumerate(items)
            ]
            (folders[kind] / f"{kind}.{half}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
            print(f"{kind}.{half}.jsonl: {len(lines)} requests from {len(funcs)} functions of {', '.join(packages)}")


if __name__ == "__main__":
    main()
