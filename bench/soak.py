"""Soak a daemon: many clients while its config is edited and k pinned and forced.

    python -m bench.soak [--clients 64] [--seconds 60] [--max-batch-size 8] [--busy N] [--json OUT]

Starts `adaspecd` on the default models with a config of its own (a free port, a private admin
socket), then for --seconds runs --clients client threads, each sending one request after another
(streaming and not, completions and chat, greedy and sampled), while a chaos thread every half
second makes a valid config edit (in place or by rename, each waited for until it applies), an
invalid one (a syntax error, a bad value, an emptied file, a model path that points nowhere, each
then undone), pins, forces or unpins k, or sends a bad admin line. Every greedy reply is compared
with target-only output computed in this process before the daemon starts. At the end the
daemon gets SIGTERM. With --busy N, N single-threaded busy processes (bench.contention's) run beside
the daemon while it is soaked.

Reports requests sent, completed, failed by HTTP status, 503s with Retry-After (backpressure, not
a failure), hung (no reply within --timeout), mismatched greedy replies, the config generation
against 1 + the valid edits, and the daemon's exit status; exits 1 on any failure, hang,
mismatch, generation drift or unclean exit.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.contention import busy_processes, stop
from control.ctl import Unreachable, request
from engine.chat_template import ChatTemplate
from engine.checkpoint import load_checkpoint
from engine.generate import generate
from engine.sampling import SamplingParams
from tools.corpus import code_prompts

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 24

CONFIG = """\
[engine]
target = "{target}"
draft = "{draft}"
max_batch_size = {max_batch_size}
max_seq_len = 1024

[adaptive]
strategy = "measured"
ema_alpha = 0.2

[admin]
socket = "{socket}"

[server]
port = {port}
max_queue = {max_queue}

[logging]
format = "json"
"""


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    tokens: int = 0  # completion tokens of the completed requests, as their usage says
    backpressure: int = 0  # 503 with Retry-After
    hung: int = 0
    mismatched: int = 0
    failed: Counter = field(default_factory=Counter)  # HTTP status (or "error") -> count
    examples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def fail(self, status: str, example: str) -> None:
        with self.lock:
            self.failed[status] += 1
            if len(self.examples) < 10:
                self.examples.append(f"{status}: {example[:300]}")


@dataclass(frozen=True)
class Case:
    path: str  # /v1/completions or /v1/chat/completions
    body: dict
    expected: str | None  # target-only text, for greedy requests


def cases(target_dir: Path) -> list[Case]:
    """Requests of every kind, each greedy one with its target-only reply."""
    target = load_checkpoint(target_dir)
    template = ChatTemplate.from_checkpoint(target_dir)
    prompts = code_prompts(6, seed=7, max_chars=600)
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    out = []
    for i, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt[-300:]}]
        rendered = template.render(messages)
        chat_ids = target.tokenizer.encode(rendered, add_special_tokens=not template.adds_special_tokens).ids
        for kind, ids, body in (
            ("/v1/completions", target.tokenizer.encode(prompt).ids, {"prompt": prompt}),
            ("/v1/chat/completions", chat_ids, {"messages": messages}),
        ):
            (completion,) = generate(target, [ids], greedy)
            expected = target.tokenizer.decode(completion.tokens)
            out.append(Case(kind, {**body, "max_tokens": MAX_TOKENS, "temperature": 0}, expected))
            sampled = {**body, "max_tokens": MAX_TOKENS, "temperature": 0.9, "top_p": 0.95, "seed": i}
            out.append(Case(kind, sampled, None))
    return out


def text_of(path: str, stream: bool, payload: bytes) -> tuple[str, int]:
    """A reply's text and its completion tokens (a stream's from its usage chunk, which the
    client asks for)."""
    if not stream:
        reply = json.loads(payload)
        choice = reply["choices"][0]
        text = choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
        return text, reply["usage"]["completion_tokens"]
    parts, tokens = [], 0
    for line in payload.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
        choice = (chunk.get("choices") or [{}])[0]
        parts.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    if "data: [DONE]" not in payload.decode():
        raise ValueError("the stream ended without [DONE]")
    return "".join(parts), tokens


def client(
    address: tuple[str, int],
    all_cases: list[Case],
    until: float,
    timeout: float,
    tally: Tally,
    seed: int,
    model: str | None = None,
) -> None:
    """Requests one after another until `until`, each counted in `tally`; `model` names the
    model in every body (a router requires it)."""
    rng = random.Random(seed)
    while time.monotonic() < until:
        case = rng.choice(all_cases)
        stream = rng.random() < 0.5
        fields = {"stream_options": {"include_usage": True}} if stream else {}
        body = json.dumps({**case.body, "stream": stream, **fields, **({"model": model} if model else {})})
        tally.note(sent=1)
        connection = http.client.HTTPConnection(*address, timeout=timeout)
        try:
            connection.request("POST", case.path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            payload = response.read()
        except TimeoutError:
            tally.note(hung=1)
            continue
        except (OSError, http.client.HTTPException) as err:
            tally.fail("error", repr(err))
            continue
        finally:
            connection.close()
        if response.status == 503 and response.getheader("Retry-After"):
            tally.note(backpressure=1)
            time.sleep(float(response.getheader("Retry-After")) * rng.uniform(0.5, 1.0))  # as a polite client does
            continue
        if response.status != 200:
            tally.fail(str(response.status), payload.decode(errors="replace"))
            continue
        try:
            text, tokens = text_of(case.path, stream, payload)
        except (ValueError, KeyError, IndexError) as err:
            tally.fail("bad body", f"{err}: {payload[:200]!r}")
            continue
        tally.note(completed=1, tokens=tokens)
        if case.expected is not None and text != case.expected:
            tally.note(mismatched=1)
            tally.fail("mismatch", f"{case.path} stream={stream}: {text!r} != {case.expected!r}")


class Chaos:
    """Valid and invalid edits, pins, forces and bad admin lines, one every half second."""

    def __init__(self, config: Path, sock: Path, rng: random.Random) -> None:
        self.config, self.socket, self.rng = config, sock, rng
        self.valid_edits = 0
        self.problems: list[str] = []
        self.actions: Counter = Counter()

    def status(self) -> dict:
        return request(self.socket, "status", timeout=10)["result"]

    def write(self, text: str, by_rename: bool) -> None:
        if by_rename:  # as most editors save: a new file renamed over the old
            temp = self.config.with_name(".config.toml.tmp")
            temp.write_text(text)
            os.replace(temp, self.config)
        else:
            self.config.write_text(text)

    def wait_for(self, check, what: str, within: float = 5.0) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if check(self.status()):
                return
            time.sleep(0.05)
        self.problems.append(f"{what} not seen within {within} s")

    def valid_edit(self) -> None:
        """Another EMA weight, or the other strategy: every runtime state either needs is built."""
        text, generation = self.config.read_text(), self.status()["generation"]
        if self.rng.random() < 0.5:
            alpha = round(self.rng.uniform(0.05, 0.95), 3)
            while f"ema_alpha = {alpha}\n" in text:
                alpha = round(self.rng.uniform(0.05, 0.95), 3)
            new = re.sub(r"(?m)^ema_alpha = .*$", f"ema_alpha = {alpha}", text)
        else:
            other = "ema" if 'strategy = "measured"' in text else "measured"
            new = re.sub(r"(?m)^strategy = .*$", f'strategy = "{other}"', text)
        self.write(new, by_rename=self.rng.random() < 0.5)
        self.valid_edits += 1
        self.wait_for(lambda s: s["generation"] == generation + 1 and s["last_reload"]["ok"], "a valid edit")

    def invalid_edit(self) -> None:
        text, generation = self.config.read_text(), self.status()["generation"]
        broken = self.rng.choice(
            [
                text.replace("ema_alpha = ", "ema_alpha = [", 1),  # a syntax error
                text.replace("ema_alpha = ", 'ema_alpha = "x" #', 1),  # a value of the wrong type
                "",  # an editor that truncated the file
                re.sub(r"(?m)^target = .*$", 'target = "/nonexistent/target"', text),  # a model not there
            ]
        )
        self.write(broken, by_rename=self.rng.random() < 0.5)
        self.wait_for(lambda s: not s["last_reload"]["ok"], "the rejection of an invalid edit")
        self.write(text, by_rename=self.rng.random() < 0.5)
        self.wait_for(lambda s: s["last_reload"]["ok"], "the undone invalid edit")
        if self.status()["generation"] != generation:
            self.problems.append("an invalid edit moved the generation")

    def admin(self) -> None:
        k = self.rng.choice([0, 1, 2, 3, 5, 7])
        cmd = self.rng.choice(["pin", "force", "unpin"])
        reply = request(self.socket, cmd, {} if cmd == "unpin" else {"steps": k}, timeout=30)
        if not reply["ok"] and reply["error"]["code"] != "rejected":
            self.problems.append(f"{cmd} {k}: {reply['error']}")

    def bad_admin_line(self) -> None:
        line = self.rng.choice([b"{nope\n", b'{"id": NaN, "cmd": "help"}\n', b"[1]\n", b'{"cmd": "frob"}\n'])
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(self.socket))
            sock.sendall(line)
            reply = json.loads(sock.recv(65536).split(b"\n")[0], parse_constant=_not_json)
        if reply.get("ok") is not False:
            self.problems.append(f"bad admin line {line!r} answered {reply}")

    def run(self, until: float) -> None:
        actions = [self.valid_edit, self.invalid_edit, self.admin, self.admin, self.bad_admin_line]
        while time.monotonic() < until:
            action = self.rng.choice(actions)
            self.actions[action.__name__] += 1
            try:
                action()
            except (Unreachable, OSError, ValueError, KeyError) as err:
                self.problems.append(f"{action.__name__}: {err!r}")
            time.sleep(0.5)
        request(self.socket, "unpin", timeout=30)


def _not_json(name: str) -> float:
    raise ValueError(f"the reply holds {name}")


def start(
    folder: Path, max_batch_size: int, max_queue: int, port: int = 0
) -> tuple[subprocess.Popen, Path, Path, tuple[str, int]]:
    """A daemon on the default models with a config of its own in `folder` (on `port`, 0: a free
    one), once it serves: its process, config, admin socket and HTTP address."""
    sock, config = folder / "admin.sock", folder / "config.toml"
    config.write_text(
        CONFIG.format(
            target=ROOT / "models" / "target",
            draft=ROOT / "models" / "draft",
            socket=sock,
            max_batch_size=max_batch_size,
            max_queue=max_queue,
            port=port,
        )
    )
    return launch(folder)


def launch(folder: Path) -> tuple[subprocess.Popen, Path, Path, tuple[str, int]]:
    """The daemon of `folder`'s config.toml (as `start` wrote it, or edited since), once it serves."""
    sock, config = folder / "admin.sock", folder / "config.toml"
    log = (folder / "daemon.log").open("a")
    process = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "--config", str(config)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the daemon exited with {process.returncode}; see {folder / 'daemon.log'}")
        try:
            status = request(sock, "status", timeout=2)["result"]
        except Unreachable:
            status = {}
        # The port listens while the models load (503 starting): serving is what the soak waits for.
        http_address = status.get("http") if status.get("state") == "serving" else None
        if http_address:
            host, port = http_address.rsplit(":", 1)
            return process, config, sock, (host, int(port))
        time.sleep(0.2)
    process.kill()
    raise SystemExit("the daemon did not start within 180 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--busy", type=int, default=0, help="single-threaded busy processes beside the daemon while it is soaked"
    )
    args = parser.parse_args(argv)

    all_cases = cases(ROOT / "models" / "target")
    folder = Path(tempfile.mkdtemp(prefix="adaspec-soak-", dir="/tmp"))
    process, config, sock, address = start(folder, args.max_batch_size, args.max_queue)
    tally, chaos = Tally(), Chaos(config, sock, random.Random(args.seed))
    until = time.monotonic() + args.seconds
    threads = [
        threading.Thread(target=client, args=(address, all_cases, until, args.timeout, tally, args.seed + i))
        for i in range(args.clients)
    ]
    threads.append(threading.Thread(target=chaos.run, args=(until,)))
    busy = busy_processes(args.busy)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(args.seconds + args.timeout + 60)
    finally:
        stop(busy)
    stuck = sum(thread.is_alive() for thread in threads)
    status = request(sock, "status", timeout=10)["result"]
    process.send_signal(signal.SIGTERM)
    try:
        exit_code = process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        exit_code = None
    report = {
        "clients": args.clients,
        "busy_processes": args.busy,
        "threads": status.get("threads"),
        "thread_switches": status.get("thread_switches"),
        "seconds": args.seconds,
        "max_batch_size": args.max_batch_size,
        "sent": tally.sent,
        "completed": tally.completed,
        "tokens": tally.tokens,
        "failed": dict(tally.failed),
        "backpressure_503": tally.backpressure,
        "hung": tally.hung + stuck,
        "mismatched": tally.mismatched,
        "valid_edits": chaos.valid_edits,
        "generation": status["generation"],
        "chaos_actions": dict(chaos.actions),
        "chaos_problems": chaos.problems,
        "exit_code": exit_code,
        "examples": tally.examples,
        "log": str(folder / "daemon.log"),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ok = (
        not tally.failed
        and report["hung"] == 0
        and tally.mismatched == 0
        and status["generation"] == 1 + chaos.valid_edits
        and not chaos.problems
        and exit_code == 0
        and tally.completed > 0
    )
    print("soak: " + ("ok" if ok else "FAILED"), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
