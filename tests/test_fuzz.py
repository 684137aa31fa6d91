"""Fuzzing a running daemon: a corpus of broken config files and of bad admin input.

Every file of the corpus is judged offline first (`parse_config` with the model check, as a
reload judges it); written live, a valid one must become the next generation and an invalid one
must be rejected with the old config kept. Bad admin input always gets a strict-JSON error reply
or a closed connection. Throughout, the daemon keeps serving completions equal to target-only
output.
"""

from __future__ import annotations

import json
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from control.issues import ConfigError
from control.load import parse_config
from engine.checkpoint import load_checkpoint
from engine.generate import generate
from engine.sampling import SamplingParams
from tests.conftest import DEFAULT_TARGET
from tests.test_daemon import Daemon, start_daemon, stop_daemon

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon(Path(tempfile.mkdtemp(prefix="adaspecd-", dir="/tmp")))
    yield d
    stop_daemon(d)


@pytest.fixture(scope="module")
def expected() -> str:
    target = load_checkpoint(DEFAULT_TARGET)
    (completion,) = generate(target, [target.tokenizer.encode(PROMPT).ids], SamplingParams(max_tokens=8))
    return target.tokenizer.decode(completion.tokens)


def still_serving(daemon: Daemon, expected: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected


def corpus(base: str, rng: random.Random) -> list[tuple[str, bytes]]:
    """(what, file contents): broken in every way a file gets broken, and a few valid edits."""
    lines = base.splitlines(keepends=True)
    settings = [i for i, line in enumerate(lines) if " = " in line and not line.startswith("#")]
    out: list[tuple[str, bytes]] = []
    data = base.encode()
    for cut in sorted(rng.sample(range(1, len(data)), 6)):
        out.append((f"half-written at byte {cut}", data[:cut]))
    out.append(("empty", b""))
    out.append(("whitespace", b" \n\t\n"))
    out.append(("binary", bytes(rng.randrange(256) for _ in range(300))))
    out.append(("nul bytes", b"\x00" * 64))
    out.append(("utf-16", base.encode("utf-16")))
    for i in rng.sample(settings, 5):
        name = lines[i].split(" = ", 1)[0]
        for value in ('"text"', "[1, 2]", "{ a = 1 }", "true", "-7", "1e999"):
            changed = lines[:i] + [f"{name} = {value}\n"] + lines[i + 1 :]
            out.append((f"{name} = {value}", "".join(changed).encode()))
    out.append(("unknown key", (base + "\n[adaptive]\nbogus = 1\n").encode()))
    out.append(("unknown section", (base + "\n[bogus]\nx = 1\n").encode()))
    out.append(("duplicate key", base.replace("ema_alpha = 0.2", "ema_alpha = 0.2\nema_alpha = 0.3").encode()))
    out.append(("huge value", base.replace('strategy = "ema"', f'strategy = "{"x" * 1_000_000}"').encode()))
    out.append(("huge key", (base + f"\n[logging]\n{'k' * 100_000} = 1\n").encode()))
    out.append(("model gone", base.replace(str(DEFAULT_TARGET), "/nonexistent/model").encode()))
    out.append(("valid: another alpha", base.replace("ema_alpha = 0.2", "ema_alpha = 0.45").encode()))
    out.append(("valid: restart-only change", base.replace("max_seq_len = 512", "max_seq_len = 600").encode()))
    return out


def offline_valid(data: bytes, path: Path) -> bool:
    try:
        parse_config(data, path=path, check_models=True)
    except ConfigError:
        return False
    return True


def write(path: Path, data: bytes, by_rename: bool) -> None:
    if by_rename:
        temp = path.with_name(".config.toml.tmp")
        temp.write_bytes(data)
        os.replace(temp, path)
    else:
        path.write_bytes(data)


def test_a_corpus_of_broken_configs_is_judged_live_as_offline_and_the_old_config_stays(daemon, expected):
    base = daemon.config.read_text()
    rng = random.Random(0)
    generation = daemon.status()["generation"]
    cases = corpus(base, rng)
    assert sum(offline_valid(data, daemon.config) for _, data in cases) >= 2
    for number, (what, data) in enumerate(cases):
        if data == base.encode():
            continue  # nothing changed: no reload to wait for
        valid = offline_valid(data, daemon.config)
        before = daemon.status()["last_reload"]["at"]
        write(daemon.config, data, by_rename=number % 2 == 1)

        def reloaded(before: float = before) -> dict | None:
            status = daemon.status()
            return status if status["last_reload"]["at"] > before else None

        status = daemon.wait_for(reloaded, 5.0, f"a reload of {what!r}")
        assert status["last_reload"]["ok"] is valid, (what, status["last_reload"])
        if valid:
            generation += 1
        assert status["generation"] == generation, what
        assert len(json.dumps(status)) < 20_000, what  # nothing the file held is echoed whole
        write(daemon.config, base.encode(), by_rename=False)
        if valid:
            generation += 1
            daemon.wait_for(lambda want=generation: daemon.status()["generation"] == want, 5.0, "the base file back")
        else:
            daemon.wait_for(lambda: daemon.status()["last_reload"]["ok"], 5.0, "the base file back")
        if number % 10 == 0:
            still_serving(daemon, expected)
    still_serving(daemon, expected)
    assert daemon.process.poll() is None


def admin_exchange(daemon: Daemon, payload: bytes, replies: int) -> list[dict]:
    """Send raw bytes on one connection; read up to `replies` lines (fewer if it closes)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(daemon.socket))
        sock.sendall(payload)
        buffer = b""
        while buffer.count(b"\n") < replies:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buffer += chunk
    return [json.loads(line, parse_constant=_not_json) for line in buffer.split(b"\n") if line]


def _not_json(name: str) -> None:
    raise AssertionError(f"a reply holds {name}")


def test_bad_admin_input_gets_strict_json_errors_and_the_daemon_keeps_serving(daemon, expected):
    rng = random.Random(1)
    generation = daemon.status()["generation"]
    garbage = [
        bytes(rng.randrange(1, 256) for _ in range(rng.randrange(1, 200))).replace(b"\n", b" ") for _ in range(20)
    ]
    wrong = [
        b"[]",
        b"42",
        b'"status"',
        b"null",
        b'{"cmd": null}',
        b'{"cmd": ["status"]}',
        b'{"cmd": "pin", "args": {"steps": "three"}}',
        b'{"cmd": "pin", "args": {"steps": -1}}',
        b'{"cmd": "pin", "args": {"steps": 1e999}}',
        b'{"cmd": "force", "args": {"steps": 99}}',  # above engine.max_k: no state can have it
        b'{"cmd": "status", "args": 7}',
        b'{"id": NaN, "cmd": "help"}',
        b'{"id": {"nested": [1, 2]}, "cmd": "nope"}',
    ]
    lines = [line for line in garbage + wrong if line.strip()]
    replies = admin_exchange(daemon, b"\n".join(lines) + b"\n", len(lines))  # pipelined on one connection
    assert len(replies) == len(lines)
    assert all(reply["ok"] is False and reply["error"]["code"] and reply["error"]["message"] for reply in replies)
    pipelined = admin_exchange(daemon, b"".join(b'{"id": %d, "cmd": "help"}\n' % i for i in range(50)), 50)
    assert [reply["id"] for reply in pipelined] == list(range(50)) and all(r["ok"] for r in pipelined)
    huge = admin_exchange(daemon, b"x" * 200_000 + b"\n" + b'{"cmd": "help"}\n', 2)
    assert len(huge) <= 1 and all(reply["ok"] is False for reply in huge)  # an error (if read first), then closed
    idle = []
    for _ in range(40):  # beyond max_connections (32): the surplus is refused or closed
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        try:
            sock.connect(str(daemon.socket))
        except OSError:
            sock.close()
            continue
        idle.append(sock)
    time.sleep(1.5)  # the idle timeout (1 s) closes them
    for sock in idle:
        sock.close()
    status = daemon.wait_for(lambda: daemon.status(), 10.0, "status after the idle connections")
    assert status["generation"] == generation and status["last_reload"]["ok"]
    still_serving(daemon, expected)
