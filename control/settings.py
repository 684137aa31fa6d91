"""The typed view of a valid file, one frozen dataclass per section; field names are the schema's
key names ([adaptive]'s policy parameters are gathered in a `PolicyParams`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.policy import PolicyParams


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
    weights: str
    max_batch_size: int
    max_seq_len: int
    max_k: int
    threads: int = 0
    tensor_parallel: int = 1
    prefill_graph_tokens: int = 2048
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
