"""While the daemon starts, the admin socket answers: `status` names the phase in progress."""

from __future__ import annotations

import pytest

from control.admin import AdminError, Peer
from daemon.commands import AdminCommands
from daemon.notify import Notifier
from daemon.startup import Startup

PEER = Peer(pid=1, uid=0, gid=0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_status_names_the_phase_and_other_commands_wait_for_ready() -> None:
    startup = Startup(Notifier(""))
    commands = AdminCommands(startup)
    with startup.phase("load target /models/target"):
        status = await commands("status", {}, PEER)
        assert status["state"] == "starting" and status["phase"] == "load target /models/target"
        with pytest.raises(AdminError) as caught:
            await commands("pin", {"steps": 3}, PEER)
        assert caught.value.code == "starting" and "load target" in caught.value.message
        assert "pin" in (await commands("help", {}, PEER))["commands"]
    status = await commands("status", {}, PEER)
    assert status["phase"] is None and [p["phase"] for p in status["phases_done"]] == ["load target /models/target"]
    with pytest.raises(RuntimeError), startup.phase("build runtime state k=3"):
        raise RuntimeError("out of memory")
    assert [p["phase"] for p in (await commands("status", {}, PEER))["phases_done"]] == ["load target /models/target"]
