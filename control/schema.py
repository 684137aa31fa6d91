"""The schema: every key of the file, its type, bounds, default and meaning, in one table
(`SCHEMA`). Validation, defaults, sources and live/restart classification all read it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from control.settings import (
    AdaptiveSettings,
    AdminSettings,
    EngineSettings,
    LoggingSettings,
    ServerSettings,
    ShutdownSettings,
)
from engine.model.config import DRAFT_QUANTIZATIONS, DRAFTERS, TARGET_WEIGHTS
from engine.policy import STRATEGY_NAMES, PolicyParams


@dataclass(frozen=True)
class Key:
    """One configuration key. `kind` is bool, int, float, str, path, ks, mode or slots."""

    kind: str
    default: Any  # a value, or a function of the explicit values {path: value} computed at load time
    doc: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is excluded
    choices: tuple[str, ...] = ()
    retired: Mapping[str, str] = field(default_factory=dict)  # choices no longer offered -> what instead
    pattern: str | None = None  # a str value must fully match this regex ...
    pattern_doc: str = ""  # ... described like this in errors
    bounded_by_max_k: bool = False  # holds draft lengths k, each of which needs a runtime state
    secret: bool = False  # shown as "<hidden>" wherever the effective config is shown

    def default_for(self, explicit: Mapping[str, Any]) -> Any:
        """The default where a file sets `explicit` ({path: value}): a computed one sees them all."""
        return self.default(explicit) if callable(self.default) else self.default


# Keys an older config may still hold, and what to do about each.
RETIRED_KEYS = {"adaptive.draft_cutoff": "it belonged to the goodput strategy, which was removed; delete the line"}


@dataclass(frozen=True)
class Section:
    settings: type
    live: bool  # True: applied to the running daemon on reload; False: needs a restart
    doc: str
    keys: Mapping[str, Key]


# Keys renamed so that "step" never means k (k is the draft length; a round is one engine
# iteration; a draft step is one draft forward): the old names still load, with a warning.
RENAMED = {
    "engine": {"max_steps": "max_k"},
    "adaptive": {"candidate_steps": "candidate_k", "static_steps": "static_k", "initial_steps": "initial_k"},
    "adaptive.slots": {"candidate_steps": "candidate_k"},
}


def _default_socket(values: Mapping[str, Any]) -> Path:
    # systemd's RuntimeDirectory= sets RUNTIME_DIRECTORY (colon-separated when several).
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        return Path(runtime.split(":")[0]) / "admin.sock"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "adaspec" / "admin.sock"
    return Path(f"/tmp/adaspec-{os.getuid()}") / "admin.sock"


# Each strategy's candidates where none are configured: SGLang's for ema; for measured, which
# tries only a k's neighbours, a ladder fine enough that a neighbour is a small step (4 was added
# on the tuning half of the workload suite: at batch 1 the best k is often 4 or 5, and 3 and 5
# were too far apart to climb between on a 2% margin; docs/benchmarks.md); positional shares it.
DEFAULT_CANDIDATES: Mapping[str, tuple[int, ...]] = {
    "ema": (1, 3, 7),
    "measured": (0, 1, 2, 3, 4, 5, 7),
    "positional": (0, 1, 2, 3, 4, 5, 7),
}


def _default_candidates(values: Mapping[str, Any]) -> tuple[int, ...]:
    strategy = values.get("adaptive.strategy")
    if not isinstance(strategy, str) or strategy not in DEFAULT_CANDIDATES:  # unset, or invalid itself
        strategy = SCHEMA["adaptive"].keys["strategy"].default
    return DEFAULT_CANDIDATES[strategy]


def _default_mode(values: Mapping[str, Any]) -> str:
    # A group is only worth naming if its members can connect.
    return "0660" if values.get("admin.group") else "0600"


_DEVICE = r"cpu|(cuda|npu)(:\d+)?"

# fmt: off
# Kept compact by hand, so that the schema reads as a table.
SLOT_KEYS: Mapping[str, Key] = {
    "min_batch_size": Key("int", None, "the slot applies while the batch holds at least this many sequences", lo=1),
    "candidate_k": Key("ks", None, "draft lengths k the policy chooses from in this slot", lo=0,
                           bounded_by_max_k=True),
}

SCHEMA: Mapping[str, Section] = {
    "engine": Section(EngineSettings, live=False, doc="models, device and capacity", keys={
        "target": Key("path", "models/target", "target checkpoint: a Hugging Face directory or a GGUF file"),
        "drafter": Key("str", "hybrid", "how drafts are proposed", choices=DRAFTERS),
        "draft": Key("path", "models/draft", "draft checkpoint (directory or GGUF), for drafter draft_model or hybrid"),
        "dflash": Key("path", "models/dflash", "DFlash drafter directory, used when drafter = dflash or hybrid_dflash"),
        "eagle3": Key("path", "models/eagle3", "EAGLE-3 head directory, used when drafter = eagle3 or hybrid_eagle3"),
        "draft_quantization": Key(
            "str", "int8", "drafters' linear weights on CPU: int8 or none (as loaded)", choices=DRAFT_QUANTIZATIONS
        ),
        "ngram_min": Key("int", 1, "shortest n-gram the lookup drafters (ngram and the hybrids) match", lo=1),
        "ngram_max": Key("int", 4, "longest n-gram the lookup drafters (ngram and the hybrids) match", lo=1),
        "lookup_history": Key("int", 16384, "tokens of finished requests that lookups search too (0: own context only)",
                              lo=0, hi=1 << 24),
        "verification": Key("str", "block", "how sampled drafts are judged: block (the chain as a whole) or token",
                            choices=("block", "token")),
        "device": Key("str", "cpu", "where the models run", pattern=_DEVICE,
                      pattern_doc="'cpu', 'cuda', 'cuda:N', 'npu' or 'npu:N'"),
        "dtype": Key("str", "auto",
                     "weight dtype; auto = bfloat16 as stored on cpu, else float32 on cpu, bfloat16 elsewhere",
                     choices=("auto", "float32", "bfloat16", "float16")),
        "weights": Key("str", "as_loaded", "the target's linear weights: as_loaded, or quantized at load in groups"
                       " of 32, int8 (as GGUF's Q8_0) or int4 (as Q4_1), served in float32", choices=TARGET_WEIGHTS),
        "max_batch_size": Key("int", 8, "most sequences decoded together", lo=1, hi=256),
        "max_seq_len": Key("int", 2048, "longest sequence (prompt + output) in tokens", lo=16, hi=32768),
        "max_k": Key("int", 32, "largest draft length k any runtime state may have", lo=1, hi=64),
        "threads": Key("int", 0, "threads of the compiled CPU forward; 0 = adapt between one and every usable"
                       " core", lo=0, hi=1024),
        "tensor_parallel": Key("int", 1, "ranks (processes) the target is split across, each holding a share of"
                               " its heads and MLP units; 1 = one process", lo=1, hi=64),
        "prefill_graph_tokens": Key("int", 2048, "CUDA: most prompt tokens one prefill runs through piecewise"
                                    " graphs; 0 = prefill eagerly", lo=0, hi=65536),
    }),
    # Each policy key's doc names the strategies that read it. The policy's defaults were chosen on
    # the tuning half of the workload suite (docs/benchmarks.md; config.toml says which).
    "adaptive": Section(AdaptiveSettings, live=True, doc="the draft-length policy", keys={
        "enabled": Key("bool", True, "adapt k to the acceptance rate; false = always static_k"),
        "static_k": Key("int", 3, "k used when enabled = false", lo=0, bounded_by_max_k=True),
        "strategy": Key("str", "positional", "policy: positional (each k's tokens from how often each draft"
                        " position is kept, its seconds measured), measured (climbs to the k measured fastest)"
                        " or ema (SGLang ladder)",
                        choices=STRATEGY_NAMES, retired={"goodput": "'measured' replaced it"}),
        "candidate_k": Key("ks", _default_candidates, "every strategy: draft lengths k the policy chooses from;"
                           " default: by strategy", lo=0, bounded_by_max_k=True),
        "initial_k": Key("int", None, "every strategy: k to start with; default: by strategy", lo=0,
                         bounded_by_max_k=True),
        "ema_alpha": Key("float", 0.2, "ema: weight of the newest round in its acceptance EMA",
                         lo=0, lo_open=True, hi=1),
        "warmup_batches": Key("int", 10, "every strategy: rounds observed before the first decision", lo=0),
        "update_interval": Key("int", 5, "every strategy: rounds between decisions", lo=1),
        "up_hysteresis": Key("float", 0.0, "ema: extra margin needed to move up a tier"),
        "down_hysteresis": Key("float", -0.25, "ema: margin (usually negative) before moving down a tier"),
        "probe_interval": Key("int", 10, "ema: rounds at k = 0 before it drafts again; measured and positional:"
                              " fewest rounds between tries of another k", lo=1),
        "switch_margin": Key("float", 0.02, "measured and positional: fraction by which a k must beat the"
                             " current one (measured: as tried; positional: as estimated)", lo=0),
        "exploration": Key("float", 0.01, "measured and positional: share of serving time tries of other k's"
                           " may lose", lo=0, lo_open=True, hi=1),
        "exploration_backoff": Key("float", 2.0, "measured: how many times longer each further try of a"
                                   " shorter k that lost again waits", lo=1),
        "draft_confidence": Key("float", 0.1, "every strategy, with the dflash, eagle3 and n-gram drafters: verify a"
                                " draft only while the drafter is at least this sure: dflash of the drafts so"
                                " far (their product), eagle3 of each greedy draft, a lookup of the drafts so far after"
                                " as long a match; 0 = all k", lo=0, hi=1),
        "per_sequence": Key("bool", False, "positional: each running sequence drafts a k of its own, by how often"
                            " its own drafts are kept at each position; false = one k for the whole batch"),
        "slots": Key("slots", (), "every strategy: candidate lists by batch size ([[adaptive.slots]])"),
    }),
    "admin": Section(AdminSettings, live=False, doc="the admin socket", keys={
        "socket": Key("path", _default_socket, "Unix socket path; default under the runtime directory"),
        "mode": Key("mode", _default_mode, "socket file mode; default 0600, or 0660 when group is set",
                    pattern=r"0?[0-7]{3}", pattern_doc='octal digits such as "0600"'),
        "group": Key("str", None, "group that owns the socket; default: the daemon's own"),
        "idle_timeout_s": Key("float", 10.0, "seconds before an idle admin connection is closed", lo=0, lo_open=True),
        "max_connections": Key("int", 32, "most admin connections open at once", lo=1),
    }),
    "server": Section(ServerSettings, live=False, doc="the HTTP API", keys={
        "host": Key("str", "127.0.0.1", "address the HTTP API listens on"),
        "port": Key("int", 8000, "TCP port of the HTTP API; 0 = any free port", lo=0, hi=65535),
        "model_name": Key("str", None, "model id the API serves; default: the target's name (less .gguf)"),
        "max_queue": Key("int", 64, "requests waiting beyond max_batch_size before new ones get 503", lo=0,
                         hi=100000),
        "api_key": Key("str", None, "key every /v1 request must send as 'Authorization: Bearer KEY'; default: "
                       "none (open), or ADASPEC_API_KEY", secret=True),
        "api_key_file": Key("path", None, "a file holding the key instead (kept out of this file)"),
        "metrics_need_key": Key("bool", False, "whether /metrics needs the key too (/health never does)"),
    }),
    "logging": Section(LoggingSettings, live=True, doc="log output", keys={
        "level": Key("str", "info", "least severe level written", choices=("debug", "info", "warning", "error")),
        "format": Key("str", "auto", "auto = console on a TTY, json otherwise", choices=("auto", "json", "console")),
    }),
    "shutdown": Section(ShutdownSettings, live=False, doc="graceful stop", keys={
        "drain_timeout_s": Key("float", 30.0, "seconds SIGTERM waits for in-flight requests", lo=0, lo_open=True),
    }),
}
# fmt: on

POLICY_FIELDS = frozenset(f.name for f in fields(PolicyParams))


def key_paths() -> tuple[str, ...]:
    """Every key path in schema order, such as "adaptive.ema_alpha"."""
    return tuple(f"{section}.{name}" for section, spec in SCHEMA.items() for name in spec.keys)


def is_live(path: str) -> bool:
    return SCHEMA[path.split(".", 1)[0]].live


def key_at(path: str) -> Key:
    """The key a path names, a slot's key (adaptive.slots[1].candidate_k) included."""
    section, name = path.split(".", 1)
    if "[" in name:  # a slot's key, such as adaptive.slots[1].candidate_k
        return SLOT_KEYS[name.rsplit(".", 1)[1]]
    return SCHEMA[section].keys[name]


def policy_params(**overrides: Any) -> PolicyParams:
    """The policy's parameters at the schema's defaults but for `overrides`, candidate_k by the
    strategy as a file's would be: for code that builds them without a file, such as tests."""
    explicit = {f"adaptive.{name}": value for name, value in overrides.items()}
    keys = SCHEMA["adaptive"].keys
    defaults = {name: keys[name].default_for(explicit) for name in POLICY_FIELDS}
    return PolicyParams(**(defaults | overrides))
