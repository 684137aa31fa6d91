"""The admin socket: one JSON request per line over a Unix stream socket, one JSON reply per line.

Transport and protocol only. What a command does is the handler's business; this module turns
lines into `handler(cmd, args, peer)` calls and results or `AdminError`s back into lines, and
makes sure that nothing a client sends (garbage, huge lines, silence, too many connections) can
disturb the daemon.

    request:  {"id": any, "cmd": "status", "args": {...}}      (args optional)
    reply:    {"id": same, "ok": true, "result": {...}}
          or  {"id": same or null, "ok": false, "error": {"code": "...", "message": "..."}}

Access control is the filesystem's: the socket is 0600 (or 0660 with an admin group) inside a
0750 directory, and every request is logged with the peer's pid and uid from SO_PEERCRED.
"""

from __future__ import annotations

import errno
import grp
import json
import math
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskStatus

from control.bounded import clip

log = structlog.get_logger("adaspec.admin")

# struct ucred: pid, uid, gid.
_UCRED = struct.Struct("3i")
# sun_path is 108 bytes and Python wants room for the terminating NUL.
_MAX_SOCKET_PATH = 107
# accept() failures caused by resource exhaustion: back off and keep serving.
_TRANSIENT_ACCEPT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
_ACCEPT_BACKOFF_S = 0.1


@dataclass(frozen=True, slots=True)
class Peer:
    """The credentials of the connecting process, as the kernel saw them at connect()."""

    pid: int
    uid: int
    gid: int


class AdminError(Exception):
    """A command failed in a way the client should hear about: becomes an error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class AdminSocketError(RuntimeError):
    """The admin socket cannot be set up: bad path, unknown group, or already in use."""


class AdminHandler(Protocol):
    async def __call__(self, cmd: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]: ...


async def serve_admin(
    path: Path,
    handler: AdminHandler,
    *,
    mode: int = 0o600,
    group: str | None = None,
    idle_timeout: float = 10.0,
    max_line: int = 65536,
    max_connections: int = 32,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin protocol on the Unix socket `path` until cancelled.

    Start it with `await tg.start(serve_admin, path, handler)`: that returns once the socket is
    bound with its final mode and group, and raises `AdminSocketError` if it cannot be. The socket
    file is removed on exit.
    """
    path = Path(path)
    gid = _group_id(group)
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise AdminSocketError(f"admin socket path is too long for AF_UNIX (max {_MAX_SOCKET_PATH} bytes): {path}")
    try:
        _make_directory(path.parent)
        _remove_stale_socket(path)
        # No mode here: anyio would chmod before our chown, briefly opening the socket to the
        # wrong group. Until the chmod below the umask applies, and connecting needs write access.
        listener = await anyio.create_unix_listener(path)
    except OSError as exc:
        raise AdminSocketError(f"cannot create the admin socket {path}: {exc}") from exc
    inode: int | None = None
    try:
        async with listener:
            inode = os.stat(path).st_ino
            _set_permissions(path, mode, gid, group)
            log.info("admin socket listening", path=str(path), mode=f"{mode:04o}", group=group)
            task_status.started()
            server = _AdminServer(handler, idle_timeout, max_line, max_connections)
            await server.serve(listener)
    finally:
        _remove_socket(path, inode)


class _AdminServer:
    def __init__(self, handler: AdminHandler, idle_timeout: float, max_line: int, max_connections: int) -> None:
        self._handler = handler
        self._idle_timeout = idle_timeout
        self._max_line = max_line
        self._max_connections = max_connections
        self._active = 0

    async def serve(self, listener: SocketListener) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                stream = await self._accept(listener)
                if self._active >= self._max_connections:
                    await self._refuse(stream)
                    continue
                # Counted here, not in the task, so that a burst of connects cannot overshoot.
                self._active += 1
                tg.start_soon(self._connection, stream)

    async def _accept(self, listener: SocketListener) -> SocketStream:
        while True:
            try:
                return await listener.accept()
            except (anyio.BrokenResourceError, OSError) as exc:
                # anyio wraps the accept() OSError in BrokenResourceError
                error = exc.__cause__ if isinstance(exc, anyio.BrokenResourceError) else exc
                if not isinstance(error, OSError) or error.errno not in _TRANSIENT_ACCEPT_ERRNOS:
                    raise
                log.warning("admin accept failed, backing off", error=str(error))
                await anyio.sleep(_ACCEPT_BACKOFF_S)

    async def _refuse(self, stream: SocketStream) -> None:
        peer = _peer_of(stream)
        log.warning("admin connection refused: too many connections", pid=peer.pid, uid=peer.uid)
        reply = _error_reply(None, "busy", f"too many admin connections (limit {self._max_connections})")
        try:
            with anyio.move_on_after(1.0):
                await stream.send(reply)
            await stream.aclose()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # it left already

    async def _connection(self, stream: SocketStream) -> None:
        peer = _peer_of(stream)
        try:
            async with stream:
                await self._converse(stream, peer)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the client went away; nothing to tell anyone
        except Exception:
            log.exception("admin connection failed", pid=peer.pid, uid=peer.uid)
        finally:
            self._active -= 1

    async def _converse(self, stream: SocketStream, peer: Peer) -> None:
        reader = _LineReader(stream, self._max_line)
        while True:
            # The timeout covers the whole line, so trickling one byte at a time does not help.
            with anyio.move_on_after(self._idle_timeout) as idle:
                try:
                    line = await reader.readline()
                except _LineTooLong:
                    message = f"request line exceeds {self._max_line} bytes"
                    log.warning("admin request too long", pid=peer.pid, uid=peer.uid)
                    await self._send(stream, _error_reply(None, "line_too_long", message))
                    return
            if idle.cancelled_caught:
                log.debug("admin client idle, closing", pid=peer.pid, uid=peer.uid)
                return
            if line is None:
                return
            if not line.strip():
                continue  # a stray Enter from an interactive client (socat, nc) is not a request
            if not await self._send(stream, await self._answer(line, peer)):
                return

    async def _send(self, stream: SocketStream, data: bytes) -> bool:
        # A client that never reads its replies would otherwise hold a connection slot forever.
        with anyio.move_on_after(self._idle_timeout):
            await stream.send(data)
            return True
        return False

    async def _answer(self, line: bytes, peer: Peer) -> bytes:
        started = time.perf_counter()
        request_id: Any = None
        cmd: str | None = None
        try:
            request = _decode_request(line)
            request_id = request.get("id")
            cmd, args = _command_of(request)
            result = await self._handler(cmd, args, peer)
            if not isinstance(result, dict):
                raise TypeError(f"admin handler returned {type(result).__name__}, not dict")
            reply = _encode({"id": request_id, "ok": True, "result": result})
            code = None
        except AdminError as exc:
            reply = _error_reply(request_id, exc.code, exc.message)
            code = exc.code
        except Exception as exc:
            log.exception("admin command failed", cmd=clip(cmd or ""), pid=peer.pid, uid=peer.uid)
            reply = _error_reply(request_id, "internal", f"internal error: {type(exc).__name__}: {exc}")
            code = "internal"
        log.info(
            "admin request",
            cmd=None if cmd is None else clip(cmd),
            pid=peer.pid,
            uid=peer.uid,
            ok=code is None,
            error=code,
            ms=round((time.perf_counter() - started) * 1000, 3),
        )
        return reply


class _NonFinite(Exception):
    pass


def _reject_constant(name: str) -> float:
    raise _NonFinite(name)


def _finite(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise _NonFinite(f"{clip(text, 20)} (beyond a float's range)")
    return number


def _decode_request(line: bytes) -> dict[str, Any]:
    try:
        # Python reads NaN and Infinity, which JSON has not: a reply echoing one would not parse.
        request = json.loads(line, parse_constant=_reject_constant, parse_float=_finite)
    except _NonFinite as exc:
        raise AdminError("bad_request", f"{exc} is not a JSON number: only finite numbers are accepted") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise AdminError("bad_json", f"request is not valid JSON: {clip(str(exc))}") from None
    if not isinstance(request, dict):
        raise AdminError("bad_request", "request must be a JSON object")
    return request


def _command_of(request: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    cmd = request.get("cmd")
    if not isinstance(cmd, str) or not cmd:
        raise AdminError("bad_request", "missing or invalid 'cmd': expected a non-empty string")
    args = request.get("args")
    if args is None:
        return cmd, {}
    if not isinstance(args, dict):
        raise AdminError("bad_request", "'args' must be a JSON object")
    return cmd, args


class _LineTooLong(Exception):
    pass


class _LineReader:
    """Newline-delimited lines from a stream socket, none longer than `max_line` bytes.

    Reads the raw socket rather than calling `SocketStream.receive()`: on asyncio, anyio (4.16)
    leaves a reader callback behind when a pending receive() is cancelled in the very loop
    iteration in which data arrives, and it fails later with InvalidStateError ("Exception in
    callback Future.set_result"). Idle timeouts and shutdown cancel pending reads routinely;
    `anyio.wait_readable` tolerates that race.
    """

    def __init__(self, stream: SocketStream, max_line: int) -> None:
        self._sock = stream.extra(SocketAttribute.raw_socket)
        self._max_line = max_line
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline
        self._eof = False

    async def readline(self) -> bytes | None:
        """The next line without its newline; None at end of stream."""
        while True:
            end = self._buffer.find(b"\n", self._scanned)
            if end >= 0:
                if end > self._max_line:
                    raise _LineTooLong
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                self._scanned = 0
                return line
            self._scanned = len(self._buffer)
            if self._scanned > self._max_line:
                raise _LineTooLong
            if self._eof:
                # A last request without its newline, from a client that shut down its side.
                line = bytes(self._buffer) or None
                self._buffer.clear()
                self._scanned = 0
                return line
            chunk = await self._receive()
            self._buffer += chunk
            self._eof = not chunk

    async def _receive(self) -> bytes:
        while True:
            try:
                return self._sock.recv(65536)  # the socket is non-blocking; b"" at end of stream
            except BlockingIOError:
                await anyio.wait_readable(self._sock)


def _encode(reply: dict[str, Any]) -> bytes:
    # ensure_ascii: whatever strings came in (lone surrogates included), the reply encodes;
    # allow_nan=False: a reply is strict JSON or an error that is.
    try:
        text = json.dumps(reply, separators=(",", ":"), allow_nan=False)
    except ValueError:
        error = {"code": "internal", "message": "the reply held a non-finite number"}
        text = json.dumps({"id": None, "ok": False, "error": error}, separators=(",", ":"))
    return text.encode("ascii") + b"\n"


def _error_reply(request_id: Any, code: str, message: str) -> bytes:
    return _encode({"id": request_id, "ok": False, "error": {"code": code, "message": message}})


def _peer_of(stream: SocketStream) -> Peer:
    try:
        sock = stream.extra(SocketAttribute.raw_socket)
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        pid, uid, gid = _UCRED.unpack(raw)
    except (OSError, AttributeError, struct.error, anyio.TypedAttributeLookupError):
        return Peer(pid=-1, uid=-1, gid=-1)  # not Linux: unknown, but still served
    return Peer(pid=pid, uid=uid, gid=gid)


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise AdminSocketError(f"admin socket group {group!r} does not exist") from None


def _make_directory(directory: Path) -> None:
    if directory.is_dir():
        return  # someone else's (systemd's RuntimeDirectory=, /tmp): leave its mode alone
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=0o750)
    except FileExistsError:
        return
    os.chmod(directory, 0o750)  # mkdir's mode went through the umask


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket left by a dead daemon; refuse to touch a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise AdminSocketError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(os.fspath(path))
    except ConnectionRefusedError:
        os.unlink(path)
        log.info("removed stale admin socket", path=str(path))
        return
    except BlockingIOError:
        pass  # a listener whose backlog is full: alive
    except OSError as exc:
        raise AdminSocketError(f"cannot check the existing socket {path}: {exc}") from exc
    finally:
        probe.close()
    raise AdminSocketError(f"{path} is in use by another process (is adaspec already running?)")


def _set_permissions(path: Path, mode: int, gid: int | None, group: str | None) -> None:
    try:
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, mode)
    except OSError as exc:
        what = f"group {group!r} and mode {mode:04o}" if group else f"mode {mode:04o}"
        raise AdminSocketError(f"cannot set {what} on {path}: {exc}") from exc


def _remove_socket(path: Path, inode: int | None) -> None:
    try:
        # Only our own: a successor may already have bound a new socket at the same path.
        if inode is None or os.lstat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove admin socket", path=str(path), error=str(exc))
