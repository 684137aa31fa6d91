"""The daemon's TOML configuration: schema, validation, immutable snapshots and diffs.

A file is validated as a whole and either becomes a `ConfigSnapshot` or is rejected with every
problem it has, so an operator fixes a bad edit in one pass and the daemon keeps running on the
previous snapshot meanwhile. The schema lives in one table, `SCHEMA`: validation, defaults,
sources and live/restart classification all read it.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from control.bounded import clip
from engine.model.config import (
    DFLASH_KINDS,
    DRAFT_MODEL_KINDS,
    DRAFT_QUANTIZATIONS,
    DRAFTERS,
    EAGLE3_KINDS,
    CheckpointError,
    ModelConfig,
    inspect_checkpoint,
    tokenizer_vocabulary,
)
from engine.policy import DEFAULT_CANDIDATES, BatchSlot, PolicyParams

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class ConfigIssue:
    path: str  # "adaptive.candidate_k", "adaptive.slots[1].min_batch_size", "<file>", "<toml>"
    message: str

    def __post_init__(self) -> None:
        # Whatever the file held, an error quotes a bounded part of it: a 10 MB value must not
        # make every status reply and log line 10 MB.
        object.__setattr__(self, "path", clip(self.path, 120))
        object.__setattr__(self, "message", clip(self.message, 400))

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


MAX_ISSUES = 50  # a file of a million bad keys is reported by its first ones


class ConfigError(Exception):
    """A configuration that cannot be used; `issues` holds every problem found, not just the first."""

    def __init__(self, issues: Sequence[ConfigIssue]) -> None:
        self.issues = list(issues[:MAX_ISSUES])
        if len(issues) > MAX_ISSUES:
            self.issues.append(ConfigIssue("<file>", f"{len(issues) - MAX_ISSUES} more problems not listed"))
        super().__init__("\n".join(str(issue) for issue in self.issues))


# ---------------------------------------------------------------------------------------------
# Settings: the typed view of a valid file. Field names are the schema's key names.


@dataclass(frozen=True)
class EngineSettings:
    target: Path
    drafter: str
    draft: Path
    draft_quantization: str
    ngram_min: int
    ngram_max: int
    lookup_history: int
    verification: str
    device: str
    dtype: str
    max_batch_size: int
    max_seq_len: int
    max_k: int
    dflash: Path | None = None
    eagle3: Path | None = None


@dataclass(frozen=True)
class AdaptiveSettings:
    enabled: bool
    static_k: int
    initial_k: int | None
    policy: PolicyParams


@dataclass(frozen=True)
class AdminSettings:
    socket: Path
    mode: str
    group: str | None
    idle_timeout_s: float
    max_connections: int

    @property
    def mode_bits(self) -> int:
        return int(self.mode, 8)


@dataclass(frozen=True)
class ServerSettings:
    host: str
    port: int
    model_name: str | None
    max_queue: int
    api_key: str | None = None
    api_key_file: Path | None = None
    metrics_need_key: bool = False


@dataclass(frozen=True)
class LoggingSettings:
    level: str
    format: str


@dataclass(frozen=True)
class ShutdownSettings:
    drain_timeout_s: float


# ---------------------------------------------------------------------------------------------
# The schema.


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


# Keys an older config may still hold, and what to do about each.
RETIRED_KEYS = {"adaptive.draft_cutoff": "it belonged to the goodput strategy, which was removed; delete the line"}


@dataclass(frozen=True)
class Section:
    settings: type
    live: bool  # True: applied to the running daemon on reload; False: needs a restart
    doc: str
    keys: Mapping[str, Key]


def _default_socket(values: Mapping[str, Any]) -> Path:
    # systemd's RuntimeDirectory= sets RUNTIME_DIRECTORY (colon-separated when several).
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        return Path(runtime.split(":")[0]) / "admin.sock"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "adaspec" / "admin.sock"
    return Path(f"/tmp/adaspec-{os.getuid()}") / "admin.sock"


def _default_candidates(values: Mapping[str, Any]) -> tuple[int, ...]:
    strategy = values.get("adaptive.strategy")
    default = DEFAULT_CANDIDATES["positional"]
    return DEFAULT_CANDIDATES.get(strategy, default) if isinstance(strategy, str) else default


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
        "target": Key("path", "models/target", "target checkpoint directory (Hugging Face format)"),
        "drafter": Key("str", "hybrid", "how drafts are proposed", choices=DRAFTERS),
        "draft": Key("path", "models/draft", "draft checkpoint directory, used when drafter = draft_model or hybrid"),
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
        "max_batch_size": Key("int", 8, "most sequences decoded together", lo=1, hi=256),
        "max_seq_len": Key("int", 2048, "longest sequence (prompt + output) in tokens", lo=16, hi=32768),
        "max_k": Key("int", 32, "largest draft length k any runtime state may have", lo=1, hi=64),
    }),
    "adaptive": Section(AdaptiveSettings, live=True, doc="the draft-length policy", keys={
        "enabled": Key("bool", True, "adapt k to the acceptance rate; false = always static_k"),
        "static_k": Key("int", 3, "k used when enabled = false", lo=0, bounded_by_max_k=True),
        "strategy": Key("str", "positional", "policy: positional (each k's tokens from how often each draft"
                        " position is kept, its seconds measured), measured (climbs to the k measured fastest)"
                        " or ema (SGLang ladder)",
                        choices=("measured", "positional", "ema"),
                        retired={"goodput": "'measured' replaced it"}),
        "candidate_k": Key("ks", _default_candidates, "draft lengths k the policy chooses from", lo=0,
                               bounded_by_max_k=True),
        "initial_k": Key("int", None, "k to start with; default: by strategy", lo=0,
                             bounded_by_max_k=True),
        "ema_alpha": Key("float", 0.2, "weight of the newest round in the ema strategy's acceptance EMA",
                         lo=0, lo_open=True, hi=1),
        "warmup_batches": Key("int", 10, "rounds observed before the first decision", lo=0),
        "update_interval": Key("int", 5, "rounds between decisions", lo=1),
        "up_hysteresis": Key("float", 0.0, "ema: extra margin needed to move up a tier"),
        "down_hysteresis": Key("float", -0.25, "ema: margin (usually negative) before moving down a tier"),
        "probe_interval": Key("int", 10, "fewest rounds between tries of another k", lo=1),
        "switch_margin": Key("float", 0.02, "measured: fraction by which a tried k must beat the current one",
                             lo=0),
        "exploration": Key("float", 0.01, "measured: share of serving time tries of other k's may lose",
                           lo=0, lo_open=True, hi=1),
        "exploration_backoff": Key("float", 2.0, "measured: how many times longer each further try of a"
                                   " shorter k that lost again waits", lo=1),
        "draft_confidence": Key("float", 0.1, "verify a draft only while the drafter is at least this sure:"
                                " dflash of the drafts so far (their product), eagle3 of each greedy draft;"
                                " 0 = all k", lo=0, hi=1),
        "slots": Key("slots", (), "candidate lists by batch size ([[adaptive.slots]])"),
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
        "model_name": Key("str", None, "model id the API serves; default: the target directory's name"),
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

_POLICY_FIELDS = frozenset(f.name for f in fields(PolicyParams))


def key_paths() -> tuple[str, ...]:
    """Every key path in schema order, such as "adaptive.ema_alpha"."""
    return tuple(f"{section}.{name}" for section, spec in SCHEMA.items() for name in spec.keys)


def is_live(path: str) -> bool:
    return SCHEMA[path.split(".", 1)[0]].live


# ---------------------------------------------------------------------------------------------
# Snapshots and diffs.


@dataclass(frozen=True)
class ConfigSnapshot:
    """One valid file, whole: the daemon swaps snapshots, it never edits one."""

    engine: EngineSettings
    adaptive: AdaptiveSettings
    admin: AdminSettings
    server: ServerSettings
    logging: LoggingSettings
    shutdown: ShutdownSettings
    generation: int
    loaded_at: float  # time.time()
    sha256: str  # of the raw file bytes
    path: Path | None
    sources: Mapping[str, str] = field(repr=False, compare=False)  # key path -> "default" | "file"
    warnings: tuple[str, ...] = field(default=(), compare=False)  # old key names it used, and others

    def get(self, path: str) -> Any:
        """The value of a key path, such as "adaptive.ema_alpha"."""
        section, name = path.split(".", 1)
        if section not in SCHEMA or name not in SCHEMA[section].keys:
            raise KeyError(path)
        holder = getattr(self, section)
        if isinstance(holder, AdaptiveSettings) and name in _POLICY_FIELDS:
            holder = holder.policy
        return getattr(holder, name)


@dataclass(frozen=True)
class ConfigDiff:
    live: tuple[str, ...]  # changed key paths a reload applies
    restart: tuple[str, ...]  # changed key paths that only take effect after a restart

    @property
    def empty(self) -> bool:
        return not self.live and not self.restart


def diff(old: ConfigSnapshot, new: ConfigSnapshot) -> ConfigDiff:
    changed = [path for path in key_paths() if old.get(path) != new.get(path)]
    return ConfigDiff(
        live=tuple(p for p in changed if is_live(p)),
        restart=tuple(p for p in changed if not is_live(p)),
    )


_NO_OVERRIDES: Mapping[str, object] = MappingProxyType({})


def effective(snapshot: ConfigSnapshot, overrides: Mapping[str, object] = _NO_OVERRIDES) -> dict[str, dict]:
    """Every key's value, where it came from, whether an edit applies live or at the next restart,
    and what it means (the schema's words); `overrides` (admin pins) win and may name keys outside
    the file's schema, such as "adaptive.pinned_k". Values are JSON-ready."""
    out = {
        path: {
            "value": _shown(path, snapshot.get(path)),
            "source": snapshot.sources[path],
            "applies": "live" if SCHEMA[path.split(".", 1)[0]].live else "at restart",
            "doc": _key(path).doc,
        }
        for path in key_paths()
    }
    for path, value in overrides.items():
        out[path] = {**out.get(path, {}), "value": _plain(value), "source": "admin"}
    return out


def _shown(path: str, value: Any) -> Any:
    return "<hidden>" if value is not None and _key(path).secret else _plain(value)


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, BatchSlot):
        return {"min_batch_size": value.min_batch_size, "candidate_k": list(value.candidate_k)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# Loading.


def load_config(path: str | os.PathLike[str], generation: int = 1, *, check_models: bool = False) -> ConfigSnapshot:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError([ConfigIssue("<file>", f"cannot read {path}: {err.strerror or err}")]) from None
    return parse_config(data, path=path, generation=generation, check_models=check_models)


def parse_config(
    text: str | bytes, *, path: Path | None = None, generation: int = 1, check_models: bool = False
) -> ConfigSnapshot:
    """Validate a whole file; raise ConfigError listing every problem, or return its snapshot.
    With `check_models`, the checkpoints it names must be in place (`model_issues`)."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    path = Path(path).absolute() if path is not None else None
    document = _read_toml(text)
    if not document and not raw.strip():
        # An editor that truncates before it writes, or `: > config.toml`: never "all defaults".
        raise ConfigError([ConfigIssue("<file>", "the file is empty")])
    issues: list[ConfigIssue] = []
    warnings = _rename_old_keys(document, issues)
    explicit, invalid = _check_document(document, issues)
    values, sources = _fill_defaults(explicit, invalid, base=path.parent if path else Path.cwd())
    _check_across(values, sources, explicit, issues)
    if check_models:
        issues += model_issues(values)
    if issues:
        raise ConfigError(issues)
    sections = {name: _build_section(name, values) for name in SCHEMA}
    return ConfigSnapshot(
        **sections,
        generation=generation,
        loaded_at=time.time(),
        sha256=hashlib.sha256(raw).hexdigest(),
        path=path,
        sources=MappingProxyType(sources),
        warnings=tuple(warnings),
    )


_TOML_POSITION = re.compile(r"\s*\((?:at line (\d+), column (\d+)|at end of document)\)$")


def _read_toml(text: str | bytes) -> dict[str, Any]:
    if not isinstance(text, str):
        try:
            text = bytes(text).decode("utf-8-sig")
        except UnicodeDecodeError as err:
            raise ConfigError([ConfigIssue("<file>", f"not UTF-8 text (byte {err.start})")]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        message = str(err.msg if hasattr(err, "msg") else err)
        lines = text.split("\n")
        line, column = getattr(err, "lineno", None), getattr(err, "colno", None)
        found = _TOML_POSITION.search(message)
        if found:  # Python < 3.14 only puts the position in the message
            message = message[: found.start()]
            if found[1]:
                line, column = int(found[1]), int(found[2])
            else:
                line, column = len(lines), len(lines[-1]) + 1
        where = f"line {line}, column {column}: " if line is not None else ""
        # The line itself names the key (tomllib's "Cannot overwrite a value" does not).
        shown = lines[line - 1].strip() if line is not None and 0 < line <= len(lines) else ""
        quoted = f" at `{shown}`" if shown else ""
        raise ConfigError([ConfigIssue("<toml>", f"{where}{message}{quoted}")]) from None


class _Invalid(Exception):
    """A value that does not fit its key; the message completes "<path>: "."""


# Keys renamed so that "step" never means k (k is the draft length; a round is one engine
# iteration; a draft step is one draft forward): the old names still load, with a warning.
RENAMED = {
    "engine": {"max_steps": "max_k"},
    "adaptive": {"candidate_steps": "candidate_k", "static_steps": "static_k", "initial_steps": "initial_k"},
    "adaptive.slots": {"candidate_steps": "candidate_k"},
}


def _rename_old_keys(document: dict[str, Any], issues: list[ConfigIssue]) -> list[str]:
    """Give old key names their new ones, in place; a warning for each (an error where a table
    has both)."""
    warnings: list[str] = []
    tables: list[tuple[str, Any]] = [(section, document.get(section)) for section in ("engine", "adaptive")]
    adaptive = document.get("adaptive")
    if isinstance(adaptive, dict) and isinstance(adaptive.get("slots"), list):
        tables += [(f"adaptive.slots[{i}]", slot) for i, slot in enumerate(adaptive["slots"])]
    for where, table in tables:
        if not isinstance(table, dict):
            continue
        renamed = RENAMED["adaptive.slots" if where.startswith("adaptive.slots") else where]
        for old, new in renamed.items():
            if old not in table:
                continue
            value = table.pop(old)
            if new in table:
                issues.append(ConfigIssue(f"{where}.{old}", f"is the old name of {new}, which is set too: keep one"))
                continue
            table[new] = value
            warnings.append(f"{where}.{old} is deprecated: it is now called {new}")
    return warnings


def _check_document(document: Mapping[str, Any], issues: list[ConfigIssue]) -> tuple[dict[str, Any], set[str]]:
    """Type- and range-check every key present; return the valid values and the invalid paths."""
    explicit: dict[str, Any] = {}
    invalid: set[str] = set()
    for section, table in document.items():
        if section not in SCHEMA:
            what = "section" if isinstance(table, dict) else "key"
            issues.append(ConfigIssue(section, f"unknown {what}{_suggest(section, SCHEMA)}"))
            continue
        if not isinstance(table, dict):
            issues.append(ConfigIssue(section, f"must be a table ([{section}]), got {_describe(table)}"))
            continue
        checked, bad = _check_table(table, SCHEMA[section].keys, section, issues)
        explicit.update(checked)
        invalid.update(bad)
    return explicit, invalid


def _check_table(
    table: Mapping[str, Any], keys: Mapping[str, Key], prefix: str, issues: list[ConfigIssue]
) -> tuple[dict[str, Any], set[str]]:
    checked: dict[str, Any] = {}
    invalid: set[str] = set()
    for name, value in table.items():
        path = f"{prefix}.{name}"
        if path in RETIRED_KEYS:
            issues.append(ConfigIssue(path, f"no longer exists: {RETIRED_KEYS[path]}"))
            continue
        if name not in keys:
            issues.append(ConfigIssue(path, f"unknown key{_suggest(name, keys)}"))
            continue
        key = keys[name]
        if key.kind == "slots":
            slots, parts = _check_slots(value, path, issues)
            checked.update(parts)  # valid entries of invalid slots are still judged against max_k
            if slots is None:
                invalid.add(path)
            else:
                checked[path] = slots
            continue
        try:
            checked[path] = _check_value(key, value)
        except _Invalid as err:
            issues.append(ConfigIssue(path, str(err)))
            invalid.add(path)
    return checked, invalid


def _check_value(key: Key, value: Any) -> Any:
    value = _CONVERT[key.kind](value)
    if key.pattern and not re.fullmatch(key.pattern, value):
        raise _Invalid(f"must be {key.pattern_doc}, got {clip(repr(value))}")
    if value in key.retired:
        raise _Invalid(f"{value!r} is no longer offered: {key.retired[value]}")
    if key.choices and value not in key.choices:
        listed = ", ".join(repr(c) for c in key.choices)
        raise _Invalid(f"must be one of {listed}, got {clip(repr(value))}{_suggest(value, key.choices)}")
    for number in value if isinstance(value, tuple) else (value,):
        if isinstance(number, int | float) and not isinstance(number, bool):
            _check_range(key, number)
    if key.kind == "mode":
        value = value.rjust(4, "0")
    return value


def _check_range(key: Key, number: float) -> None:
    too_low = key.lo is not None and (number <= key.lo if key.lo_open else number < key.lo)
    too_high = key.hi is not None and number > key.hi
    if not (too_low or too_high):
        return
    low = "" if key.lo is None else f"{'>' if key.lo_open else '>='} {_num(key.lo)}"
    high = "" if key.hi is None else f"<= {_num(key.hi)}"
    raise _Invalid(f"must be {' and '.join(b for b in (low, high) if b)}, got {number}")


def _check_slots(
    value: Any, path: str, issues: list[ConfigIssue]
) -> tuple[tuple[BatchSlot, ...] | None, dict[str, Any]]:
    """The slots (None if any is invalid), and every valid key of every slot by path."""
    parts: dict[str, Any] = {}
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        issues.append(ConfigIssue(path, f"must be an array of tables ([[{path}]]), got {_describe(value)}"))
        return None, parts
    slots: list[BatchSlot] = []
    seen: dict[int, int] = {}  # min_batch_size -> index of the slot that has it
    ok = True
    for i, item in enumerate(value):
        prefix = f"{path}[{i}]"
        checked, bad = _check_table(item, SLOT_KEYS, prefix, issues)
        parts.update(checked)
        ok = ok and not bad
        for name in SLOT_KEYS:
            if f"{prefix}.{name}" not in checked and f"{prefix}.{name}" not in bad:
                issues.append(ConfigIssue(f"{prefix}.{name}", "missing: every slot needs it"))
                ok = False
        size = checked.get(f"{prefix}.min_batch_size")
        if size in seen:
            issues.append(ConfigIssue(f"{prefix}.min_batch_size", f"{size} is already used by {path}[{seen[size]}]"))
            ok = False
        elif size is not None:
            seen[size] = i
        if ok:
            slots.append(BatchSlot(size, checked[f"{prefix}.candidate_k"]))
    return (tuple(slots) if ok else None), parts


def _to_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"must be true or false, got {_describe(value)}")
    return value


def _to_int(value: Any) -> int:
    # TOML booleans are not numbers, although Python's bool is an int.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"must be an integer, got {_describe(value)}")
    return value


def _to_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(f"must be a number, got {_describe(value)}")
    if not math.isfinite(value):
        raise _Invalid(f"must be a finite number, got {value}")
    return float(value)


def _to_str(value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"must be a string, got {_describe(value)}")
    if not value.strip():
        raise _Invalid("must not be empty")
    return value


def _to_mode(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        raise _Invalid(f'must be a string of octal digits such as "0600", got the integer {value}')
    return _to_str(value)


def _to_ks(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _Invalid(f"must be an array of integers, got {_describe(value)}")
    if not value:
        raise _Invalid("must not be empty")
    wrong = [v for v in value if isinstance(v, bool) or not isinstance(v, int)]
    if wrong:
        raise _Invalid(f"must hold integers only, got {_describe(wrong[0])}")
    repeated = sorted({v for v in value if value.count(v) > 1})
    if repeated:
        raise _Invalid(f"has duplicates: {', '.join(map(str, repeated))}")
    return tuple(value)


_CONVERT: Mapping[str, Callable[[Any], Any]] = {
    "bool": _to_bool,
    "int": _to_int,
    "float": _to_float,
    "str": _to_str,
    "path": _to_str,  # resolved against the config directory once the base is known
    "mode": _to_mode,
    "ks": _to_ks,
}


def _fill_defaults(explicit: Mapping[str, Any], invalid: set[str], base: Path) -> tuple[dict[str, Any], dict[str, str]]:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for path in key_paths():
        if path in explicit:
            values[path], sources[path] = explicit[path], "file"
        elif path not in invalid:
            values[path], sources[path] = None, "default"
    # Computed defaults see every explicit value, whatever the key order.
    for path, source in sources.items():
        key = _key(path)
        if source == "default":
            values[path] = key.default(explicit) if callable(key.default) else key.default
        if key.kind == "path" and values[path] is not None:
            values[path] = _resolve(values[path], base)
    return values, sources


def _resolve(value: str | Path, base: Path) -> Path:
    return base / Path(value).expanduser()


def model_issues(values: Mapping[str, Any]) -> list[ConfigIssue]:
    """Whether the target, and the draft where the drafter runs one, are checkpoint directories
    (config.json of a supported architecture, weights, tokenizer.json), and the draft shares the
    target's tokenizer; read without loading any weights."""
    issues: list[ConfigIssue] = []
    found = {}
    names = ["engine.target"]
    if values.get("engine.drafter") in DRAFT_MODEL_KINDS:
        names.append("engine.draft")
    for name in names:
        if values.get(name) is None:
            continue  # invalid itself: already reported
        try:
            found[name] = (values[name], inspect_checkpoint(values[name]))
        except CheckpointError as err:
            issues.append(ConfigIssue(name, str(err)))
    # The drafters fed the target's hidden states: their checkpoint, checked against the target,
    # the weights by their file's header.
    for kinds, name in ((DFLASH_KINDS, "engine.dflash"), (EAGLE3_KINDS, "engine.eagle3")):
        path = values.get(name)
        if values.get("engine.drafter") in kinds and "engine.target" in found and path is not None:
            try:
                _inspect_drafter(name, path, found["engine.target"][1])
            except CheckpointError as err:
                issues.append(ConfigIssue(name, str(err)))
    if len(found) == 2:
        (target, target_config), (draft, draft_config) = found["engine.target"], found["engine.draft"]
        same_vocabulary = tokenizer_vocabulary(draft) == tokenizer_vocabulary(target)
        if draft_config.vocab_size != target_config.vocab_size or not same_vocabulary:
            issues.append(
                ConfigIssue(
                    "engine.draft",
                    f"{draft} does not share the target's tokenizer (vocabulary of {draft_config.vocab_size}, "
                    f'the target {target_config.vocab_size}): pick a draft of the same family, or drafter = "ngram"',
                )
            )
    return issues


def _inspect_drafter(name: str, path: Path, target: ModelConfig) -> None:
    """The feature drafter `name` configures, checked against the target by its config and its
    weights' header. Its module (which needs torch) is imported only where one is configured, so
    a check of any other config stays quick."""
    if name == "engine.dflash":
        from engine.model.dflash import inspect_dflash_weights as inspect
    else:
        from engine.model.eagle3 import inspect_eagle3_weights as inspect
    inspect(path, target)


def read_key_file(path: str | os.PathLike[str]) -> str:
    """The API key a file holds, its text without surrounding whitespace; ValueError naming the
    file where it cannot be read or holds nothing."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ValueError(f"cannot read {path}: {reason}") from None
    if not key:
        raise ValueError(f"{path}: the key file is empty")
    return key


def _check_across(
    values: Mapping[str, Any], sources: Mapping[str, str], explicit: Mapping[str, Any], issues: list[ConfigIssue]
) -> None:
    """Rules that involve more than one key. A key that is itself invalid is not judged again."""
    if values.get("server.api_key") is not None and values.get("server.api_key_file") is not None:
        issues.append(ConfigIssue("server.api_key_file", "set server.api_key or server.api_key_file, not both"))
    if values.get("server.api_key") == "":
        issues.append(ConfigIssue("server.api_key", "must not be empty (leave it out for an open API)"))
    key_file = values.get("server.api_key_file")
    if key_file is not None:
        try:
            read_key_file(key_file)
        except ValueError as err:
            issues.append(ConfigIssue("server.api_key_file", str(err)))
    low, high = values.get("engine.ngram_min"), values.get("engine.ngram_max")
    if low is not None and high is not None and low > high:
        issues.append(ConfigIssue("engine.ngram_min", f"must be <= engine.ngram_max ({high}), got {low}"))
    max_k = values.get("engine.max_k")
    if max_k is None:
        return
    checks = [(path, value, sources[path]) for path, value in values.items()]
    checks += [(path, value, "file") for path, value in explicit.items() if path not in sources]  # slots' keys
    for path, value, source in checks:
        if not _key(path).bounded_by_max_k or value is None:
            continue
        above = [k for k in (value if isinstance(value, tuple) else (value,)) if k > max_k]
        if above:
            hint = " (the default; set it explicitly)" if source == "default" else ""
            issues.append(ConfigIssue(path, f"{', '.join(map(str, above))} above engine.max_k = {max_k}{hint}"))


def _build_section(section: str, values: Mapping[str, Any]) -> Any:
    kwargs = {name: values[f"{section}.{name}"] for name in SCHEMA[section].keys}
    if section == "adaptive":
        policy = {name: kwargs.pop(name) for name in list(kwargs) if name in _POLICY_FIELDS}
        try:
            kwargs["policy"] = PolicyParams(**policy)
        except ValueError as err:  # only if PolicyParams grows a rule this schema lacks
            raise ConfigError([ConfigIssue("adaptive", str(err))]) from None
    return SCHEMA[section].settings(**kwargs)


def _key(path: str) -> Key:
    section, name = path.split(".", 1)
    if "[" in name:  # a slot's key, such as adaptive.slots[1].candidate_k
        return SLOT_KEYS[name.rsplit(".", 1)[1]]
    return SCHEMA[section].keys[name]


def _suggest(word: str, known: Sequence[str] | Mapping[str, Any]) -> str:
    if len(word) > 64:
        return ""  # no key or choice is that long, and matching one would take a while
    close = difflib.get_close_matches(word, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _describe(value: Any) -> str:
    """A value as TOML would name it: "string 'x'", "boolean true", "table"."""
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"float {value}"
    if isinstance(value, str):
        return f"string {clip(repr(value))}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"{type(value).__name__} {value}"  # dates and times


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
