"""Loading: a file is read and validated as a whole and either becomes a `ConfigSnapshot` or is
rejected with every problem it has, so an operator fixes a bad edit in one pass and the daemon
keeps running on the previous snapshot meanwhile."""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from control.issues import ConfigError, ConfigIssue
from control.model_checks import model_issues
from control.schema import POLICY_FIELDS, RENAMED, RETIRED_KEYS, SCHEMA, SLOT_KEYS, Key, key_at, key_paths
from control.snapshot import ConfigSnapshot
from control.toml_errors import explain
from control.values import InvalidValue, check_value, describe, suggest
from engine.policy import BatchSlot, PolicyParams

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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
        at_end = bool(found and not found[1])
        explained = explain(lines, line, at_end) if line is not None else None
        if explained is None:
            where = f"line {line}, column {column}: " if line is not None else ""
            # The line itself names the key (tomllib's "Cannot overwrite a value" does not).
            shown = lines[line - 1].strip() if line is not None and 0 < line <= len(lines) else ""
            quoted = f" at `{shown}`" if shown else ""
            explained = f"{where}{message}{quoted}"
        raise ConfigError([ConfigIssue("<toml>", explained)]) from None


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
            issues.append(ConfigIssue(section, f"unknown {what}{suggest(section, SCHEMA)}"))
            continue
        if not isinstance(table, dict):
            issues.append(ConfigIssue(section, f"must be a table ([{section}]), got {describe(table)}"))
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
            issues.append(ConfigIssue(path, f"unknown key{suggest(name, keys)}"))
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
            checked[path] = check_value(key, value)
        except InvalidValue as err:
            issues.append(ConfigIssue(path, str(err)))
            invalid.add(path)
    return checked, invalid


def _check_slots(
    value: Any, path: str, issues: list[ConfigIssue]
) -> tuple[tuple[BatchSlot, ...] | None, dict[str, Any]]:
    """The slots (None if any is invalid), and every valid key of every slot by path."""
    parts: dict[str, Any] = {}
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        issues.append(ConfigIssue(path, f"must be an array of tables ([[{path}]]), got {describe(value)}"))
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
        key = key_at(path)
        if source == "default":
            values[path] = key.default_for(explicit)
        if key.kind == "path" and values[path] is not None:
            values[path] = _resolve(values[path], base)
    return values, sources


def _resolve(value: str | Path, base: Path) -> Path:
    return base / Path(value).expanduser()


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
        if not key_at(path).bounded_by_max_k or value is None:
            continue
        above = [k for k in (value if isinstance(value, tuple) else (value,)) if k > max_k]
        if above:
            hint = " (the default; set it explicitly)" if source == "default" else ""
            issues.append(ConfigIssue(path, f"{', '.join(map(str, above))} above engine.max_k = {max_k}{hint}"))


def _build_section(section: str, values: Mapping[str, Any]) -> Any:
    kwargs = {name: values[f"{section}.{name}"] for name in SCHEMA[section].keys}
    if section == "adaptive":
        policy = {name: kwargs.pop(name) for name in list(kwargs) if name in POLICY_FIELDS}
        try:
            kwargs["policy"] = PolicyParams(**policy)
        except ValueError as err:  # only if PolicyParams grows a rule this schema lacks
            raise ConfigError([ConfigIssue("adaptive", str(err))]) from None
    return SCHEMA[section].settings(**kwargs)
