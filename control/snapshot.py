"""Snapshots of a valid file, the diff between two, and the effective values with their sources."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from control.schema import POLICY_FIELDS, SCHEMA, is_live, key_at, key_paths
from control.settings import (
    AdaptiveSettings,
    AdminSettings,
    EngineSettings,
    LoggingSettings,
    ServerSettings,
    ShutdownSettings,
)
from engine.policy import BatchSlot


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
        if isinstance(holder, AdaptiveSettings) and name in POLICY_FIELDS:
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
            "doc": key_at(path).doc,
        }
        for path in key_paths()
    }
    for path, value in overrides.items():
        out[path] = {**out.get(path, {}), "value": _plain(value), "source": "admin"}
    return out


def _shown(path: str, value: Any) -> Any:
    return "<hidden>" if value is not None and key_at(path).secret else _plain(value)


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, BatchSlot):
        return {"min_batch_size": value.min_batch_size, "candidate_k": list(value.candidate_k)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value
