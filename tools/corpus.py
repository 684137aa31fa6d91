"""The CPython standard library as a corpus: the default models learnt it outside its tests
(models/README.md); its tests are held out, and code prompts are cut from them."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): every .py of the stdlib, held out if under test(s)/."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in ("site-packages", "dist-packages") or "__pycache__" in parts:
            continue
        (held_out if ("test" in parts[:-1] or "tests" in parts[:-1]) else train).append(path)
    return train, held_out


def held_out_files() -> list[Path]:
    """The standard library's tests: none of them was trained on."""
    return stdlib_files()[1]


def code_prompts(count: int, seed: int = 0, max_chars: int = 1200, files: list[Path] | None = None) -> list[str]:
    """`count` prompts, each a held-out file's text (the standard library's tests, or `files`) up
    to and including a random `def` line; fewer if the files hold too few `def` lines to find."""
    rng = random.Random(seed)
    files = held_out_files() if files is None else files
    prompts: list[str] = []
    for _ in range(100 * count if files else 0):
        if len(prompts) == count:
            break
        path = rng.choice(files)
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        defs = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and i > 5]
        if not defs:
            continue
        end = rng.choice(defs) + 1
        text = "".join(lines[:end])[-max_chars:]
        # Start at a line boundary so the prompt does not open mid-token.
        prompts.append(text[text.index("\n") + 1 :] if "\n" in text[:-1] else text)
    return prompts
