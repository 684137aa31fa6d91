"""One target across ranks (engine/parallel.py): two real processes in a gloo group on this CPU,
each holding half of every layer; rank 0 runs the engine, the drafter and the choice of k."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.core import Engine
from engine.drafters.draft_model import DraftModelDrafter
from engine.generate import generate
from engine.parallel import Plan, free_port, shard
from engine.request import Request
from engine.sampling import SamplingParams
from tests.conftest import DEFAULT_DRAFT, DEFAULT_TARGET, ROOT

PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 9, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 8, 9], [20, 21, 22]]
MAX_SEQ_LEN, MAX_TOKENS, STEPS = 128, 32, (0, 1, 2, 3, 5)


def rank_main(rank: int, address: str, batch_size: int, out: Path, hang: bool = False, adaptive: bool = False) -> None:
    """One rank of two: rank 0 serves PROMPTS[:batch_size] at a k drawn at random every round, or
    as the shipped positional policy chooses it (`adaptive`)."""
    from control.schema import policy_params
    from engine.controller import Controller
    from engine.parallel import Leader, RankLost, close, follow, init

    torch.set_num_threads(1)
    init(rank, 2, address, torch.device("cpu"))
    target = load_checkpoint(DEFAULT_TARGET, native_forward=False)
    shard(target.model, rank, 2)
    try:
        if rank:
            plans = follow(target.model, keep=True)
            out.write_text(json.dumps([p.k for p in plans]))
            close()
            return
        leader = Leader.of(target.model)
        leader.keep()
        leader.start(batch_size, MAX_SEQ_LEN)
        draft = load_checkpoint(DEFAULT_DRAFT, native_forward=False)
        engine = Engine(target, DraftModelDrafter(draft, batch_size, MAX_SEQ_LEN), batch_size, MAX_SEQ_LEN, STEPS)
        rng = random.Random(batch_size)
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        controller = Controller(engine, policy_params(strategy="positional", candidate_k=STEPS)) if adaptive else None
        rounds: list[int] = []
        while True:
            requests = [Request(tuple(p), params) for p in PROMPTS[:batch_size]]
            outputs: dict[str, list[int]] = {r.id: [] for r in requests}
            for request in requests:
                engine.add_request(request)
            while engine.has_work:
                k = controller.k if controller else rng.choice(STEPS)
                rounds.append(k)
                result = controller.step() if controller else engine.step(k)
                for done in result.outputs:
                    outputs[done.request_id].extend(done.new_tokens)
                time.sleep(0.1 if hang else 0)
            if not hang:  # serves on, as a daemon would, until the group fails
                break
        leader.stop()
        close()
        out.write_text(
            json.dumps(
                {
                    "outputs": [outputs[r.id] for r in requests],
                    "plans": [p.k for p in leader.plans or []],
                    "rounds": rounds,
                }
            )
        )
    except RankLost as err:
        print(f"rank {rank}: lost rank {1 - rank} ({err})", file=sys.stderr, flush=True)
        sys.exit(1)


def run_ranks(batch_size: int, tmp_path: Path, adaptive: bool) -> tuple[dict, list[int]]:
    address = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    code = "import sys; from pathlib import Path; from tests.test_parallel import rank_main; "
    code += "rank_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), adaptive=sys.argv[5] == '1')"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), address, str(batch_size), str(outs[r]), str(int(adaptive))],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for rank in ranks:
        _, err = rank.communicate(timeout=300)
        assert rank.returncode == 0, err[-3000:]
    return json.loads(outs[0].read_text()), json.loads(outs[1].read_text())


@pytest.mark.parametrize("batch_size, adaptive", [(1, False), (4, False), (4, True)])
def test_two_ranks_serve_what_one_does_with_k_switched_every_round(batch_size, adaptive, tmp_path):
    """Greedy output through two ranks equals target-only output of the whole model, token for
    token, with k drawn at random every round or chosen by the adaptive policy on rank 0; rank 1
    ran every forward rank 0 ran, at the same k."""
    target = load_checkpoint(DEFAULT_TARGET, native_forward=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [c.tokens for c in generate(target, PROMPTS[:batch_size], params)]
    leader, follower = run_ranks(batch_size, tmp_path, adaptive)
    assert leader["outputs"] == expected
    assert follower == leader["plans"]  # every forward, the same width (a round at k verifies k + 1 a row)
    assert len(set(leader["rounds"])) > 1 and set(leader["rounds"]) <= {p for p in follower} | {0}  # k changed


def test_a_model_that_ranks_cannot_share_evenly_is_refused():
    target = load_checkpoint(DEFAULT_TARGET, native_forward=False)
    with pytest.raises(ValueError, match="4 ranks cannot share 6 heads"):
        shard(target.model, 0, 4)
    with pytest.raises(ValueError, match="native_forward=False"):
        shard(load_checkpoint(DEFAULT_TARGET).model, 0, 2)


def test_a_plan_says_the_round_it_verifies():
    plan = Plan([0, 1], [5, 9], [[1, 2, 3, 4], [5]], False, ())
    assert plan.k == 3


@pytest.mark.parametrize("killed", [1, 0])
def test_killing_one_rank_ends_the_other_with_a_line_naming_it(tmp_path, killed):
    """Whichever rank dies, the other's next collective fails: it exits non-zero within 10 s,
    saying which rank it lost (a daemon's supervisor then restarts the group)."""
    address = f"127.0.0.1:{free_port()}"
    code = "import sys; from pathlib import Path; from tests.test_parallel import rank_main; "
    code += "rank_main(int(sys.argv[1]), sys.argv[2], 1, Path(sys.argv[3]), hang=True)"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), address, str(tmp_path / f"rank{r}.json")],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    time.sleep(12)  # both up and serving (rank 0 sleeps between rounds)
    assert all(rank.poll() is None for rank in ranks)
    ranks[killed].send_signal(signal.SIGKILL)
    at = time.monotonic()
    survivor = ranks[1 - killed]
    _, err = survivor.communicate(timeout=30)
    assert time.monotonic() - at < 10
    assert survivor.returncode != 0 and f"rank {1 - killed}: lost rank {killed}" in err, err[-2000:]


def test_the_daemon_serves_a_target_split_across_two_ranks_and_stops_when_one_is_lost():
    """[engine] tensor_parallel = 2: the daemon starts rank 1 itself, serves greedy completions
    equal to the whole model's output, stops it cleanly with itself, and stops with a non-zero
    status and a line naming the rank when that rank is killed."""
    import httpx

    from tests.test_daemon import start_daemon, stop_daemon

    target = load_checkpoint(DEFAULT_TARGET, native_forward=False)
    prompt = "def add(a, b):"
    ids = target.tokenizer.encode(prompt).ids
    (expected,) = generate(target, [ids], SamplingParams(max_tokens=16, ignore_eos=True))
    daemon = start_daemon(Path(tempfile.mkdtemp(prefix="adaspecd-", dir="/tmp")), engine="tensor_parallel = 2")
    try:
        (rank,) = daemon.status()["ranks"]
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["text"] == target.tokenizer.decode(expected.tokens)
    finally:
        stop_daemon(daemon)
    assert daemon.process.returncode == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{rank}") and "Z" not in _state(rank):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{rank}") or "Z" in _state(rank)  # rank 1 ended with the daemon

    daemon = start_daemon(Path(tempfile.mkdtemp(prefix="adaspecd-", dir="/tmp")), engine="tensor_parallel = 2")
    try:
        (rank,) = daemon.status()["ranks"]
        os.kill(rank, signal.SIGKILL)
        code = daemon.process.wait(15)
        assert code != 0
        lost = daemon.events("a rank of the tensor-parallel group is gone; stopping")
        assert lost and lost[0]["lost"].startswith("rank 1 exited")
    finally:
        stop_daemon(daemon)


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
    except OSError:
        return "gone"
