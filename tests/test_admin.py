"""The admin socket server (control/admin.py) and the adaspecctl client (control/ctl.py), over real
Unix sockets."""

from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from control.admin import AdminError, AdminHandler, AdminSocketError, Peer, serve_admin
from control.ctl import default_socket_path, format_value

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sock_path(tmp_path: Path) -> Any:
    """A socket path inside a not-yet-existing directory, short enough for AF_UNIX (108 bytes)."""
    base = tmp_path
    made = None
    if len(os.fsencode(tmp_path)) > 80:
        base = made = Path(tempfile.mkdtemp(prefix="as-", dir="/tmp"))
    yield base / "run" / "admin.sock"
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


async def toy_handler(cmd: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
    if cmd == "echo":
        return {"args": args, "peer": {"pid": peer.pid, "uid": peer.uid, "gid": peer.gid}}
    if cmd == "fail":
        raise AdminError("nope", "failed on purpose")
    if cmd == "crash":
        raise RuntimeError("boom")
    if cmd == "slow":
        await anyio.sleep(args.get("s", 0.1))
        return {"slept": args.get("s", 0.1)}
    raise AdminError("unknown_command", f"unknown command {cmd!r}")


@asynccontextmanager
async def running(path: Path, handler: AdminHandler = toy_handler, **options: Any) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        await tg.start(partial(serve_admin, path, handler, **options))
        yield
        tg.cancel_scope.cancel()


class Client:
    """A bare line-protocol client, so that tests can send anything at all."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.buffer = b""

    async def send(self, data: bytes | dict[str, Any]) -> None:
        if isinstance(data, dict):
            data = json.dumps(data).encode() + b"\n"
        await self.stream.send(data)

    async def recv(self) -> dict[str, Any] | None:
        """The next reply, or None at end of stream (or a reset after it)."""
        with anyio.fail_after(5):
            while b"\n" not in self.buffer:
                try:
                    self.buffer += await self.stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line, parse_constant=strict_json)

    async def call(self, cmd: str, args: dict[str, Any] | None = None, id: Any = 1) -> dict[str, Any] | None:
        request: dict[str, Any] = {"id": id, "cmd": cmd}
        if args is not None:
            request["args"] = args
        await self.send(request)
        return await self.recv()


def strict_json(name: str) -> Any:
    raise AssertionError(f"the reply holds {name}, which is not JSON")


@asynccontextmanager
async def connect(path: Path) -> AsyncIterator[Client]:
    async with await anyio.connect_unix(path) as stream:
        yield Client(stream)


async def test_round_trip_ok_and_error(sock_path: Path) -> None:
    async with running(sock_path), connect(sock_path) as client:
        reply = await client.call("echo", {"x": [1, 2]}, id="a")
        assert reply is not None
        assert reply["id"] == "a" and reply["ok"] is True
        assert reply["result"]["args"] == {"x": [1, 2]}

        assert await client.call("fail", id=2) == {
            "id": 2,
            "ok": False,
            "error": {"code": "nope", "message": "failed on purpose"},
        }
        reply = await client.call("what", id=3)
        assert reply is not None and reply["error"]["code"] == "unknown_command"
        # args are optional; null counts as absent
        assert (await client.call("echo", id=4) or {})["result"]["args"] == {}
        await client.send(b'{"id": 5, "cmd": "echo", "args": null}\n')
        assert (await client.recv() or {})["result"]["args"] == {}


async def test_peer_credentials_reach_the_handler(sock_path: Path) -> None:
    async with running(sock_path), connect(sock_path) as client:
        reply = await client.call("echo")
        assert reply is not None
        assert reply["result"]["peer"] == {"pid": os.getpid(), "uid": os.getuid(), "gid": os.getgid()}


async def test_requests_on_one_connection_are_answered_in_order(sock_path: Path) -> None:
    async with running(sock_path), connect(sock_path) as client:
        lines = [
            {"id": 1, "cmd": "slow", "args": {"s": 0.1}},
            {"id": 2, "cmd": "echo"},
            {"id": 3, "cmd": "fail"},
        ]
        await client.send(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        replies = [await client.recv() for _ in lines]
        assert [reply["id"] for reply in replies if reply] == [1, 2, 3]
        assert [reply["ok"] for reply in replies if reply] == [True, True, False]


@pytest.mark.parametrize(
    ("line", "code", "reply_id"),
    [
        (b"{nope\n", "bad_json", None),
        (b"\xff\xfe{}\n", "bad_json", None),
        (b"[" * 60000 + b"\n", "bad_json", None),  # nesting deeper than the parser's recursion limit
        (b"[1, 2]\n", "bad_request", None),
        (b'"status"\n', "bad_request", None),
        (b'{"id": 7}\n', "bad_request", 7),
        (b'{"id": 8, "cmd": ""}\n', "bad_request", 8),
        (b'{"id": 9, "cmd": 42}\n', "bad_request", 9),
        (b'{"id": 10, "cmd": "echo", "args": [1]}\n', "bad_request", 10),
        (b'{"id": NaN, "cmd": "help"}\n', "bad_request", None),  # Python reads NaN; JSON has none
        (b'{"id": 11, "cmd": "echo", "args": {"x": -Infinity}}\n', "bad_request", None),
        (b'{"id": 12, "cmd": "echo", "args": {"x": 1e999}}\n', "bad_request", None),  # overflows to inf
    ],
)
async def test_bad_requests_get_error_replies(sock_path: Path, line: bytes, code: str, reply_id: Any) -> None:
    async with running(sock_path), connect(sock_path) as client:
        await client.send(line)
        reply = await client.recv()
        assert reply is not None
        assert reply["ok"] is False and reply["id"] == reply_id
        assert reply["error"]["code"] == code and reply["error"]["message"]
        # the connection survives a bad request
        assert (await client.call("echo") or {})["ok"] is True


async def test_blank_lines_are_ignored_and_crlf_accepted(sock_path: Path) -> None:
    async with running(sock_path), connect(sock_path) as client:
        await client.send(b'\n\r\n{"id": 1, "cmd": "echo"}\r\n')
        assert (await client.recv() or {})["id"] == 1


async def test_oversized_line_gets_a_reply_then_the_connection_closes(sock_path: Path) -> None:
    async with running(sock_path, max_line=1024):
        async with connect(sock_path) as client:
            # exactly max_line bytes is still fine
            request = json.dumps({"id": 1, "cmd": "echo", "args": {"pad": ""}})
            request = request.replace('""', '"' + "x" * (1024 - len(request)) + '"')
            assert len(request) == 1024
            await client.send(request.encode() + b"\n")
            assert (await client.recv() or {})["ok"] is True

            await client.send(b'{"id": 2, "cmd": "echo", "args": {"pad": "' + b"x" * 2000 + b'"}}\n')
            reply = await client.recv()
            assert reply is not None
            assert reply["error"]["code"] == "line_too_long" and reply["id"] is None
            assert await client.recv() is None
        # also without any newline in sight
        async with connect(sock_path) as client:
            await client.send(b"x" * 5000)
            assert (await client.recv() or {})["error"]["code"] == "line_too_long"
            assert await client.recv() is None
        async with connect(sock_path) as client:
            assert (await client.call("echo") or {})["ok"] is True


async def test_handler_crash_is_internal_and_the_server_keeps_serving(sock_path: Path) -> None:
    async with running(sock_path):
        async with connect(sock_path) as client:
            reply = await client.call("crash", id=11)
            assert reply is not None and reply["id"] == 11 and reply["ok"] is False
            assert reply["error"]["code"] == "internal" and "boom" in reply["error"]["message"]
            assert (await client.call("echo") or {})["ok"] is True  # same connection
        async with connect(sock_path) as client:
            assert (await client.call("echo") or {})["ok"] is True  # next client


async def test_non_dict_or_unserialisable_result_is_internal(sock_path: Path) -> None:
    async def handler(cmd: str, args: dict[str, Any], peer: Peer) -> Any:
        return [1] if cmd == "list" else {"value": object() if cmd == "object" else float("nan")}

    async with running(sock_path, handler), connect(sock_path) as client:
        assert (await client.call("list") or {})["error"]["code"] == "internal"
        assert (await client.call("object") or {})["error"]["code"] == "internal"
        assert (await client.call("nan") or {})["error"]["code"] == "internal"  # strict JSON, always


async def test_last_request_without_newline_is_answered_after_half_close(sock_path: Path) -> None:
    async with running(sock_path), connect(sock_path) as client:
        await client.send(b'{"id": 1, "cmd": "echo"}')
        await client.stream.send_eof()
        assert (await client.recv() or {})["ok"] is True
        assert await client.recv() is None


async def test_idle_client_is_disconnected(sock_path: Path) -> None:
    async with running(sock_path, idle_timeout=0.2):
        async with connect(sock_path) as client:
            with anyio.fail_after(3):
                assert await client.recv() is None
        # a line trickled in slower than the timeout does not keep the connection either
        async with connect(sock_path) as client:
            await client.send(b'{"id": 1,')
            await anyio.sleep(0.1)
            await client.send(b' "cmd"')
            with anyio.fail_after(3):
                assert await client.recv() is None
        # the timeout is per line: an active client stays
        async with connect(sock_path) as client:
            for _ in range(3):
                assert (await client.call("echo") or {})["ok"] is True
                await anyio.sleep(0.1)


async def test_max_connections(sock_path: Path) -> None:
    async with running(sock_path, max_connections=2):
        async with connect(sock_path) as first, connect(sock_path) as second:
            assert (await first.call("echo") or {})["ok"] is True
            assert (await second.call("echo") or {})["ok"] is True
            async with connect(sock_path) as third:
                reply = await third.recv()
                assert reply is not None and reply["error"]["code"] == "busy" and reply["id"] is None
                assert await third.recv() is None
        # the slots are given back once the clients leave
        with anyio.fail_after(5):
            while True:
                async with connect(sock_path) as client:
                    if (await client.call("echo") or {}).get("ok"):
                        break
                await anyio.sleep(0.02)


async def test_socket_file_mode_directory_and_cleanup(sock_path: Path) -> None:
    async with running(sock_path):
        st = os.stat(sock_path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert stat.S_IMODE(os.stat(sock_path.parent).st_mode) == 0o750
    assert not sock_path.exists()

    group = grp.getgrgid(os.getgid()).gr_name
    async with running(sock_path, mode=0o660, group=group):
        st = os.stat(sock_path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
    assert not sock_path.exists()


async def test_unknown_group_fails_at_startup(sock_path: Path) -> None:
    with pytest.raises(AdminSocketError, match="no-such-group-adaspec"):
        await serve_admin(sock_path, toy_handler, group="no-such-group-adaspec")
    assert not sock_path.exists()


async def test_stale_socket_is_replaced_but_a_live_one_is_not(sock_path: Path) -> None:
    sock_path.parent.mkdir(mode=0o750)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()  # the file stays, nobody listens: what a killed daemon leaves behind
    async with running(sock_path), connect(sock_path) as client:
        assert (await client.call("echo") or {})["ok"] is True
        with pytest.raises(AdminSocketError, match="in use"):
            await serve_admin(sock_path, toy_handler)
        assert (await client.call("echo") or {})["ok"] is True

    sock_path.write_text("not a socket")
    with pytest.raises(AdminSocketError, match="not a socket"):
        await serve_admin(sock_path, toy_handler)
    assert sock_path.read_text() == "not a socket"


async def test_path_too_long_is_a_clear_error(sock_path: Path) -> None:
    with pytest.raises(AdminSocketError, match="too long"):
        await serve_admin(sock_path.parent / ("x" * 120) / "admin.sock", toy_handler)


# adaspecctl, run as a real subprocess against a server in this test.


async def ctl_handler(cmd: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
    if cmd == "status":
        return {"state": "serving", "k": 4, "rates": {"accept": 0.75}, "steps": [1, 2, 4], "pinned": None}
    if cmd in ("pin", "force"):
        return {"mode": cmd, "k": args["k"]}
    if cmd == "unpin":
        return {}
    if cmd == "reload":
        raise AdminError("reload_rejected", "engine.max_k: must be positive")
    raise AdminError("unknown_command", cmd)


async def ctl(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    environ = {k: v for k, v in os.environ.items() if k != "ADASPEC_SOCKET"} | (env or {})
    process = await anyio.run_process([sys.executable, "-m", "control.ctl", *argv], check=False, cwd=ROOT, env=environ)
    return process.returncode, process.stdout.decode(), process.stderr.decode()


async def test_ctl_against_a_live_server(sock_path: Path) -> None:
    sock = str(sock_path)
    async with running(sock_path, ctl_handler):
        code, out, err = await ctl("--socket", sock, "status")
        assert (code, err) == (0, "")
        assert out.splitlines() == [
            "state: serving",
            "k: 4",
            "rates:",
            "  accept: 0.75",
            "steps: [1, 2, 4]",
            "pinned: null",
        ]

        code, out, _ = await ctl("status", "--json", env={"ADASPEC_SOCKET": sock})
        assert code == 0 and json.loads(out)["rates"] == {"accept": 0.75}

        code, out, _ = await ctl("--socket", sock, "--json", "pin", "3")
        assert code == 0 and json.loads(out) == {"mode": "pin", "k": 3}
        code, out, _ = await ctl("--socket", sock, "force", "0")
        assert code == 0 and out.splitlines() == ["mode: force", "k: 0"]
        code, out, _ = await ctl("--socket", sock, "unpin")
        assert (code, out) == (0, "")

        code, out, err = await ctl("--socket", sock, "reload")
        assert (code, out) == (1, "")
        assert err.strip() == "error [reload_rejected]: engine.max_k: must be positive"
        code, out, _ = await ctl("--socket", sock, "--json", "reload")
        assert code == 1 and json.loads(out) == {
            "code": "reload_rejected",
            "message": "engine.max_k: must be positive",
        }


async def test_ctl_sends_one_command_to_several_daemons(sock_path: Path) -> None:
    """--socket given several times (before and after the command): each daemon gets the command
    in turn and its reply is shown under its socket; one that does not answer does not stop the
    others, and the exit status says the worst."""
    first, second = sock_path, sock_path.parent.parent / "second" / "admin.sock"
    pinned: dict[str, int] = {}

    def remembering(name: str) -> AdminHandler:
        async def handler(cmd: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
            if cmd == "pin":
                pinned[name] = args["k"]
            return await ctl_handler(cmd, args, peer)

        return handler

    async with running(first, remembering("first")), running(second, remembering("second")):
        code, out, err = await ctl("--socket", str(first), "pin", "3", "--socket", str(second))
        assert (code, err) == (0, "") and pinned == {"first": 3, "second": 3}
        assert out.splitlines() == [f"{first}:", "  mode: pin", "  k: 3", f"{second}:", "  mode: pin", "  k: 3"]
        code, out, _ = await ctl("--socket", str(first), "--socket", str(second), "--json", "status")
        replies = json.loads(out)
        assert code == 0 and [r["socket"] for r in replies] == [str(first), str(second)]
        assert all(r["ok"] and r["result"]["k"] == 4 for r in replies)

        code, out, err = await ctl("--socket", str(first), "--socket", str(second), "reload")
        assert code == 1 and err.count("error [reload_rejected]") == 2

        missing = sock_path.parent.parent / "gone" / "admin.sock"
        code, out, err = await ctl("--socket", str(missing), "--socket", str(first), "pin", "5")
        assert code == 3 and pinned["first"] == 5  # the daemon after the missing one got it
        assert f"{missing}: failed" in out and f"{first}:" in out and "no such socket" in err
        code, out, _ = await ctl("--socket", str(missing), "--socket", str(second), "--json", "unpin")
        assert code == 3 and [r["ok"] for r in json.loads(out)] == [False, True]
        assert json.loads(out)[0]["error"]["code"] == "unreachable"


async def test_ctl_usage_errors_and_unreachable_socket(sock_path: Path) -> None:
    for argv in (
        ["pin"],
        ["pin", "-1"],
        ["force", "two"],
        ["frobnicate"],
        [],
        ["status", "--timeout", "0"],
        ["status", "--timeout", "inf"],
    ):
        code, _, err = await ctl("--socket", str(sock_path), *argv)
        assert code == 2, argv
        assert "usage" in err

    code, out, err = await ctl("--socket", str(sock_path), "status")
    assert code == 3 and out == ""
    assert str(sock_path) in err and "no such socket" in err

    sock_path.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()
    code, _, err = await ctl("--socket", str(sock_path), "status")
    assert code == 3 and "refused" in err
    code, out, _ = await ctl("--socket", str(sock_path), "--json", "status")
    assert code == 3 and json.loads(out)["code"] == "unreachable"  # scripts reading JSON get JSON
    # Something other than a socket at the path says so, not "refused".
    code, _, err = await ctl("--socket", str(sock_path.parent), "status")
    assert code == 3 and "a directory, not a socket" in err
    sock_path.unlink()
    sock_path.write_text("")
    code, _, err = await ctl("--socket", str(sock_path), "status")
    assert code == 3 and "not a socket" in err

    sock_path.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:  # listens, never answers
        mute.bind(str(sock_path))
        mute.listen()
        code, _, err = await ctl("--socket", str(sock_path), "--timeout", "0.3", "status")
    assert code == 3 and "no reply" in err


def test_ctl_default_socket_path() -> None:
    assert default_socket_path({"ADASPEC_SOCKET": "/x/a.sock", "RUNTIME_DIRECTORY": "/run/a"}) == Path("/x/a.sock")
    assert default_socket_path({"RUNTIME_DIRECTORY": "/run/adaspec:/run/other"}) == Path("/run/adaspec/admin.sock")
    assert default_socket_path({"XDG_RUNTIME_DIR": "/run/user/7"}) == Path("/run/user/7/adaspec/admin.sock")
    assert default_socket_path({}) == Path(f"/tmp/adaspec-{os.getuid()}/admin.sock")


def test_ctl_readable_format() -> None:
    result = {
        "a": 1,
        "b": {"c": "text", "d": {}, "e": []},
        "f": [{"g": 1, "h": [1, 2]}, 3],
        "i": True,
        "j": "two\nlines",
    }
    assert format_value(result) == [
        "a: 1",
        "b:",
        "  c: text",
        "  d: {}",
        "  e: []",
        "f:",
        "  - g: 1",
        "    h: [1, 2]",
        "  - 3",
        "i: true",
        "j:",
        "  two",
        "  lines",
    ]
