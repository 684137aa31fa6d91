"""adaspecctl: send one command to running adaspec daemons over their admin sockets.

    adaspecctl [--socket PATH]... [--json] [--timeout S] COMMAND [ARGS]

Exit status: 0 ok, 1 the daemon answered with an error, 2 usage error, 3 no answer (socket
missing or refusing, timeout, connection dropped). `ExecReload=adaspecctl reload` therefore makes
`systemctl reload` fail visibly when the daemon rejects a new configuration.

`--socket` given several times sends the command to each daemon in turn (replicas behind a
router: pin or unpin k on all of them, read every status); each reply is shown under its socket,
a socket that does not answer does not stop the others, and the exit status is the worst one
(3 where any did not answer, else 1 where any answered with an error).

A plain blocking socket and no third-party imports: this runs once per command and should start
fast.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from control.arguments import above_zero

EXIT_OK = 0
EXIT_ERROR_REPLY = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 86400.0  # a day: longer is a mistake (and past what a socket timeout takes)
_MAX_REPLY_BYTES = 64 * 1024 * 1024

# command -> (help, whether it takes a draft length K)
COMMANDS: dict[str, tuple[str, bool]] = {
    "status": ("show the daemon's state, acceptance rates and current draft length", False),
    "config": ("show the effective configuration and where each value came from", False),
    "help": ("list the commands the daemon understands", False),
    "reload": ("re-read the configuration file now", False),
    "pin": ("pin the draft length to K until unpin", True),
    "force": ("force the draft length to K", True),
    "unpin": ("return to the adaptive draft length", False),
}


class Unreachable(Exception):
    """No usable reply: the message says which socket and why."""


class _NoReply(Exception):
    pass


def default_socket_path(environ: Mapping[str, str] | None = None) -> Path:
    """$ADASPEC_SOCKET, else the systemd RuntimeDirectory, else the user's runtime dir, else /tmp."""
    env = os.environ if environ is None else environ
    if env.get("ADASPEC_SOCKET"):
        return Path(env["ADASPEC_SOCKET"])
    if env.get("RUNTIME_DIRECTORY"):
        # systemd joins several RuntimeDirectory= entries with ":"; the first is ours.
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / "admin.sock"
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "adaspec" / "admin.sock"
    return Path(f"/tmp/adaspec-{os.getuid()}") / "admin.sock"


def request(
    path: Path, cmd: str, args: dict[str, Any] | None = None, *, timeout: float = DEFAULT_TIMEOUT_S
) -> dict[str, Any]:
    """Send one request and return the reply object; `Unreachable` when there is none."""
    deadline = time.monotonic() + timeout
    line = json.dumps({"id": 1, "cmd": cmd, "args": args or {}}).encode() + b"\n"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.settimeout(timeout)
            sock.connect(os.fspath(path))
            sock.sendall(line)
            reply = _read_line(sock, deadline)
        except FileNotFoundError:
            raise Unreachable(f"cannot connect to {path}: no such socket (is adaspec running?)") from None
        except ConnectionRefusedError:
            raise Unreachable(f"cannot connect to {path}: {_refused_because(path)}") from None
        except PermissionError:
            raise Unreachable(f"cannot connect to {path}: permission denied (not in the admin group?)") from None
        except TimeoutError:
            raise Unreachable(f"no reply from {path} within {timeout:g} s") from None
        except _NoReply as exc:
            raise Unreachable(f"no reply from {path}: {exc}") from None
        except OSError as exc:
            raise Unreachable(f"cannot talk to {path}: {exc.strerror or exc}") from None
    finally:
        sock.close()
    try:
        obj = json.loads(reply)
    except ValueError:
        raise Unreachable(f"malformed reply from {path}: {reply[:200]!r}") from None
    if not isinstance(obj, dict) or "ok" not in obj:
        raise Unreachable(f"malformed reply from {path}: {reply[:200]!r}")
    return obj


def _refused_because(path: Path) -> str:
    """Why a connection to `path` was refused: something else is there, or a socket nobody serves."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = stat.S_IFSOCK
    if stat.S_ISDIR(mode):
        return "a directory, not a socket (--socket names the socket file itself)"
    if not stat.S_ISSOCK(mode):
        return "not a socket (--socket names the daemon's admin socket, [admin] socket in its config)"
    return "connection refused (stale socket: is adaspec running?)"


def _read_line(sock: socket.socket, deadline: float) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        chunk = sock.recv(65536)
        if not chunk:
            raise _NoReply("the connection was closed")
        newline = chunk.find(b"\n")
        if newline >= 0:
            chunks.append(chunk[:newline])
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > _MAX_REPLY_BYTES:
            raise _NoReply(f"the reply exceeds {_MAX_REPLY_BYTES} bytes")


def format_value(value: Any, indent: int = 0) -> list[str]:
    """Readable `key: value` lines for a reply's result, YAML-like and compact."""
    pad = "  " * indent
    if isinstance(value, dict):
        if not value:
            return [pad + "{}"]
        lines: list[str] = []
        for key, item in value.items():
            if _is_block(item):
                lines.append(f"{pad}{key}:")
                lines.extend(format_value(item, indent + 1))
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
        return lines
    if isinstance(value, list):
        if not _is_block(value):
            return [pad + _scalar(value)]
        lines = []
        for item in value:
            if _is_block(item):
                nested = format_value(item, indent + 1)
                # "- " takes the place of the nested block's indentation on its first line.
                lines.append(f"{pad}- {nested[0].lstrip()}")
                lines.extend(nested[1:])
            else:
                lines.append(f"{pad}- {_scalar(item)}")
        return lines
    if isinstance(value, str) and "\n" in value:
        return [pad + line for line in value.splitlines()]
    return [pad + _scalar(value)]


def _is_block(value: Any) -> bool:
    """Whether `value` needs lines of its own: a non-empty dict, a list holding containers, or a
    multi-line string."""
    if isinstance(value, str):
        return "\n" in value
    if isinstance(value, dict):
        return bool(value)
    if isinstance(value, list):
        return any(isinstance(item, dict | list) and item for item in value)
    return False


def _scalar(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(item) for item in value) + "]"
    return json.dumps(value)  # null, true/false, numbers, {} and []


def _k(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"K must be a non-negative integer, not {text!r}") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"K must be a non-negative integer, not {text!r}")
    return k


def _timeout(text: str) -> float:
    seconds = above_zero(text)
    if seconds > MAX_TIMEOUT_S:  # inf too
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TIMEOUT_S:g} seconds, not {text}")
    return seconds


def _add_common_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    # The options are accepted before and after the command. On the subparsers their default is
    # SUPPRESS: a subparser default would overwrite a value given before the command.
    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    # Sockets after the command are kept apart from those before it (a subparser's value would
    # replace, not extend, the main parser's).
    parser.add_argument(
        "--socket",
        type=Path,
        action="append",
        dest="socket" if defaults else "sockets_after",
        default=default(None),
        metavar="PATH",
        help="admin socket path (several: the command goes to each)",
    )
    parser.add_argument("--json", action="store_true", default=default(False), help="print the reply as JSON")
    parser.add_argument(
        "--timeout", type=_timeout, default=default(DEFAULT_TIMEOUT_S), metavar="S", help="seconds to wait"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaspecctl",
        description="Control a running adaspec daemon through its admin socket.",
        epilog="exit status: 0 ok, 1 error reply, 2 usage error, 3 daemon unreachable",
    )
    _add_common_options(parser, defaults=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (text, takes_k) in COMMANDS.items():
        sub = commands.add_parser(name, help=text, description=text)
        if takes_k:
            sub.add_argument("k", type=_k, metavar="K", help="draft length (non-negative integer)")
        _add_common_options(sub, defaults=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        options = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 after --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE

    paths = (options.socket or []) + (getattr(options, "sockets_after", None) or []) or [default_socket_path()]
    args = {"k": options.k} if COMMANDS[options.command][1] else {}
    outcomes: list[tuple[Path, int, dict[str, Any]]] = []
    for path in dict.fromkeys(paths):
        try:
            outcomes.append((path, *_outcome(request(path, options.command, args, timeout=options.timeout))))
        except Unreachable as exc:
            outcomes.append((path, EXIT_UNREACHABLE, {"code": "unreachable", "message": str(exc)}))
        except KeyboardInterrupt:
            return 130
    if len(outcomes) == 1:
        _show(*outcomes[0], json_out=options.json)
    elif options.json:
        print(json.dumps([_entry(path, code, body) for path, code, body in outcomes], indent=2))
    else:
        for path, code, body in outcomes:
            _show(path, code, body, json_out=False, heading=True)
    codes = {code for _, code, _ in outcomes}
    return EXIT_UNREACHABLE if EXIT_UNREACHABLE in codes else max(codes)


def _outcome(reply: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A reply as (exit status, its result or its error)."""
    if reply.get("ok"):
        return EXIT_OK, reply.get("result", {})
    error = reply.get("error")
    if not isinstance(error, dict):
        error = {"code": "unknown", "message": repr(error)}
    return EXIT_ERROR_REPLY, error


def _entry(path: Path, code: int, body: dict[str, Any]) -> dict[str, Any]:
    """One socket's outcome in --json's list for several sockets."""
    return {"socket": str(path), "ok": code == EXIT_OK, ("result" if code == EXIT_OK else "error"): body}


def _show(path: Path, code: int, body: dict[str, Any], *, json_out: bool, heading: bool = False) -> None:
    """One socket's outcome: the result on stdout, an error or no answer on stderr (JSON on stdout
    with --json, so that a script reading JSON gets JSON); under a heading naming the socket
    where several were asked."""
    if heading:
        print(f"{path}:" if code == EXIT_OK else f"{path}: failed", flush=True)
    if json_out:
        print(json.dumps(body, indent=2))
    elif code == EXIT_OK:
        lines = format_value(body, indent=1 if heading else 0) if body else []
        if lines:
            print("\n".join(lines))
    elif code == EXIT_UNREACHABLE:
        print(f"adaspecctl: {body['message']}", file=sys.stderr, flush=True)
    else:
        print(f"error [{body.get('code', 'unknown')}]: {body.get('message', '')}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
