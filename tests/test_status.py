"""What the admin `status` command shows (daemon/commands.py): moments as ISO 8601 with their UTC
offset, and runtime-state memory as null where the backend does not measure it (a CPU)."""

from __future__ import annotations

from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from control.admin import Peer
from daemon.commands import AdminCommands
from daemon.notify import Notifier
from daemon.reload import ReloadOutcome, iso_time
from daemon.startup import Startup
from engine.device.backend import Backend, CpuBackend, backend_for
from engine.loop import StateInfo

pytestmark = pytest.mark.anyio
PEER = Peer(pid=1, uid=0, gid=0)
AT = 1_795_890_005.123  # 2026-11-28T18:20:05.123 UTC


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class MeasuringBackend(CpuBackend):
    """A backend that accounts memory, as CUDA's and Ascend's do."""

    measures_memory = True

    def memory_reserved(self) -> int:
        return 1 << 20


def serving(backend: Backend) -> AdminCommands:
    """AdminCommands over stand-ins for the engine loop and the reloader: what `status` reads."""
    states = (StateInfo(1, 0.5, 0, {1: 0.002}), StateInfo(3, 0.7, 4096, {1: 0.003}))
    engine_status = SimpleNamespace(
        k=3,
        mode="adaptive",
        params=SimpleNamespace(strategy="ema", slots=()),
        candidates=(1, 3),
        ema=0.5,
        round=10,
        switches=2,
        states=states,
        tokens_per_s=12.0,
        tokens=100,
        mean_accepted_drafts=1.5,
        running=0,
        threads=2,
        thread_switches=0,
        sequence_rounds={0: 4, 3: 16},
    )
    engine = SimpleNamespace(drafter=SimpleNamespace(name="draft_model"), backend=backend)
    loop: Any = SimpleNamespace(status=engine_status, engine=engine, in_flight=0)
    snapshot = SimpleNamespace(generation=2, sha256="ab" * 32, warnings=())
    last = ReloadOutcome(ok=True, trigger="watch", generation=2, at=AT)
    reloader: Any = SimpleNamespace(snapshot=snapshot, last=last, failures=0)
    commands = AdminCommands(Startup(Notifier("")))
    commands.serve(loop, reloader)
    return commands


def test_iso_time_is_utc_with_its_offset_to_the_millisecond() -> None:
    assert iso_time(AT) == "2026-11-28T18:20:05.123+00:00"
    parsed = datetime.fromisoformat(iso_time(AT))
    assert parsed.utcoffset() == timedelta(0) and abs(parsed.timestamp() - AT) < 1e-3
    assert ReloadOutcome(ok=False, trigger="admin", generation=1, at=AT).as_dict()["at"] == iso_time(AT)


async def test_status_shows_the_last_reload_time_as_iso_8601() -> None:
    status = await serving(CpuBackend(torch.device("cpu")))("status", {}, PEER)
    assert status["last_reload"]["at"] == "2026-11-28T18:20:05.123+00:00"
    # nothing else in status is a moment as a raw epoch float: uptime is a duration
    assert status["uptime_s"] >= 0


async def test_runtime_state_memory_is_null_on_a_cpu() -> None:
    cpu = backend_for(torch.device("cpu"))
    assert not cpu.measures_memory and not Backend(torch.device("cpu")).measures_memory
    status = await serving(cpu)("status", {}, PEER)
    assert [s["memory_bytes"] for s in status["runtime_states"]] == [None, None]


async def test_runtime_state_memory_is_shown_where_the_backend_measures_it() -> None:
    backend = MeasuringBackend(torch.device("cpu"))
    assert backend.measures_memory
    status = await serving(backend)("status", {}, PEER)
    assert [s["memory_bytes"] for s in status["runtime_states"]] == [0, 4096]  # a measured 0 stays 0


async def test_status_shows_how_many_sequences_rounds_drafted_each_k() -> None:
    status = await serving(CpuBackend(torch.device("cpu")))("status", {}, PEER)
    assert status["sequence_rounds"] == {"0": 4, "3": 16}  # JSON keys: the draft lengths as text
