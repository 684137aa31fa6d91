"""The training scripts (tools/train_eagle3.py, and what it shares with tools/train_dflash.py):
the chain the head is trained on is the one it serves, options and runs that cannot give a
drafter are refused by name, the loss falls, a widened head starts as the narrower one, and the
data is the target's own output."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from engine.drafters.eagle3 import Eagle3Drafter
from engine.generate import generate
from engine.model.eagle3 import Eagle3Model, load_eagle3
from engine.request import Request, Sequence
from engine.sampling import SamplingParams
from tests.conftest import ROOT
from tests.test_eagle3 import head_for
from tests.test_speculative import MAX_SEQ_LEN, PROMPTS


def test_the_served_chain_is_the_unroll_it_was_trained_on(tmp_path):
    """tools/train_eagle3.py computes a chain's logits (training-time test) as the drafter does
    when serving (on PyTorch operators, as training runs): the same tokens give the same logits
    at every step of the chain."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_eagle3 import chain_attention

    from tests.conftest import tiny_pair

    target, _ = tiny_pair(tmp_path, native_forward=False)
    head = head_for(target.model, taps=(0, 1, 1))
    tokens = torch.tensor([PROMPTS[0] + PROMPTS[2] + PROMPTS[1]])
    start, unroll = 9, 4
    with torch.no_grad():
        _, taps = target.model.train_layers(tokens, head.taps)
        embeds = target.model.embed_tokens(tokens).float()
        features = head.features(torch.cat([taps[i] for i in head.taps], dim=-1).float())
        entries = tokens.shape[1] - 1
        _, keys, values = head.qkv(embeds[:, 1:], features[:, :entries], torch.arange(entries))
        starts, rows = torch.tensor([[start]]), torch.arange(1)[:, None]
        feature, own, trained = features[rows, starts], [], []
        for j in range(unroll):
            q, k, v = head.qkv(embeds[rows, starts + j + 1], feature, starts + j)
            if j > 0:
                own.append((k, v))
            feature = head.finish(chain_attention(q, keys, values, starts, own), feature)
            trained.append(head.logits(feature)[0, 0])

    drafter = Eagle3Drafter(head, target.model, 1, MAX_SEQ_LEN)
    prefix = tokens[0, : start + 2].tolist()  # positions 0..start went through the target
    cache = target.model.new_cache(1, MAX_SEQ_LEN)
    slot = cache.allocate()
    hidden = target.model(target.model.batch(cache, [slot], [prefix[:-1]]), cache, capture=drafter.capture_layers)
    seq = Sequence(Request(tuple(prefix), SamplingParams()), slot=0, generator=None, tokens=list(prefix))
    drafter.admit([seq], hidden.hidden)
    drafter.catch_up([seq])
    served = [drafter.next_logits[seq.draft_slot].clone()]
    for j in range(1, unroll):
        served.append(drafter.draft([seq.draft_slot], [int(tokens[0, start + 1 + j])], j - 1)[0])
    for j in range(unroll):
        assert torch.allclose(served[j], trained[j], atol=1e-4), f"step {j}"


@pytest.mark.parametrize(
    "option, named",
    [
        (["--greedy-weight", "1.5"], "--greedy-weight must be between 0 and 1, not 1.5"),
        (["--time-budget", "-5"], "--time-budget must be 0 (train --steps) or a number of seconds, not -5.0"),
        (["--intermediate-size", "-1"], "argument --intermediate-size: must be at least 0, not -1"),
        (["--chains", "0"], "argument --chains: must be at least 1, not 0"),
        (["--lr", "-1"], "argument --lr: must be above 0, not -1"),
        (["--regenerate", "-3"], "argument --regenerate: must be at least 0, not -3"),
        (["--seq-len", "5"], "--seq-len must be above --unroll + 1 (8), not 5"),
        (["--sampled-share", "2"], "--sampled-share must be between 0 and 1, not 2.0"),
        (["--sample-temperature", "0"], "argument --sample-temperature: must be above 0, not 0"),
    ],
)
def test_the_training_script_names_an_option_out_of_range(tmp_path, option, named):
    out = tmp_path / "head"
    command = [sys.executable, "tools/train_eagle3.py", "models/target", str(out), *option]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and named in done.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "script, option, named",
    [
        ("train_eagle3.py", ["--taps", "99", "0", "1"], "taps [99] outside the target's layers 0..7"),
        ("train_eagle3.py", ["--lr", "1e30", "--steps", "5"], "try a lower --lr"),
        ("train_eagle3.py", ["--data", "/nowhere"], "/nowhere: no such file or folder"),
        ("train_dflash.py", ["--mask-token", "999999"], "mask token id 999999 outside the vocabulary"),
        ("train_dflash.py", ["--taps", "99"], "--taps 99: the target has 8 layers to tap"),
        ("train_dflash.py", ["--lr", "1e30", "--steps", "5"], "try a lower --lr"),
    ],
)
def test_a_training_run_that_cannot_give_a_drafter_stops_with_a_line_saying_why(tmp_path, script, option, named):
    # A loss that is no longer a number stops the run before a drafter of NaN weights is saved.
    (tmp_path / "data.txt").write_text(" ".join(f"w{i % 37}" for i in range(400)))
    out = tmp_path / "drafter"
    command = [sys.executable, f"tools/{script}", "models/target", str(out), "--seq-len", "40", "--batch", "2"]
    command += ["--prompts", "0", "--data", str(tmp_path / "data.txt"), *option]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and named in done.stderr and "Traceback" not in done.stderr
    assert not (out / "model.safetensors").exists()


def test_the_training_script_runs_end_to_end_and_its_loss_falls(pair, tmp_path):
    """On the target's own greedy continuations of a small corpus: the loss (KL from the target's
    distribution, every unrolled step) falls, the head loads, and a second run resumes."""
    import random

    target, _ = pair
    rng = random.Random(3)
    (tmp_path / "data.txt").write_text(" ".join(f"w{rng.randrange(2, 40)}" for _ in range(400)))
    out, work = tmp_path / "head", tmp_path / "work"
    command = [sys.executable, "tools/train_eagle3.py", str(target.path), str(out), "--steps", "60", "--unroll", "3"]
    command += ["--seq-len", "40", "--prompt-len", "16", "--regenerate", "12", "--chains", "8", "--batch", "4"]
    command += ["--lr", "3e-3", "--data", str(tmp_path / "data.txt"), "--prompts", "0", "--work", str(work)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "training_report.json").read_text())
    assert report["last_loss"] < 0.6 * report["first_loss"]
    assert len(report["last_loss_per_step"]) == 3
    head = load_eagle3(out, target.model)
    assert head.taps == tuple(report["taps"])
    assert head.config.sliding_window == 40  # no further back at inference than its training sequences
    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "resuming at step 60" in resumed.stderr
    # The same --work, other options: its checkpoint and its sequences are named, not loaded.
    other = subprocess.run(command + ["--draft-vocab", "16"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert other.returncode == 1 and f"{work / 'state.pt'}: left by a run with other options" in other.stderr
    longer = [*command, "--seq-len", "48"]
    other = subprocess.run(longer, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (
        other.returncode == 1
        and f"{work / 'greedy.pt'}: holds sequences of 40 tokens, not --seq-len 48" in other.stderr
    )

    # A head over the 16 most frequent tokens, started from the first one's rows for them.
    reduced = tmp_path / "reduced"
    command[3], command[5] = str(reduced), "10"
    command[command.index("--work") + 1] = str(tmp_path / "work16")
    command += ["--init", str(out), "--draft-vocab", "16"]
    # Held-out files of its own: the head serves prompts cut from them at the end.
    lines = [" ".join(f"w{rng.randrange(2, 40)}" for _ in range(6)) for _ in range(12)]
    (tmp_path / "held.py").write_text("\n".join(lines[:8] + ["def w3(w4):"] + lines[8:]) + "\n")
    command[command.index("--prompts") + 1] = "2"
    # ...and trained on the cross-entropy of the target's argmax as much as on the KL.
    command += ["--held-out", str(tmp_path / "held.py"), "--greedy-weight", "0.5"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    reduced_report = json.loads((reduced / "training_report.json").read_text())
    assert reduced_report["greedy_weight"] == 0.5 and reduced_report["last_loss"] < reduced_report["first_loss"]
    held_out = reduced_report["held_out"]
    assert held_out["rounds"] > 0 and len(held_out["kept_at_position"]) == 3
    small = load_eagle3(reduced, target.model)
    ids = small.draft_to_target()
    counts = torch.bincount(torch.load(work / "greedy.pt").flatten(), minlength=64)
    outside = counts.clone()
    outside[ids] = -1
    assert small.config.draft_vocab_size == 16 and int(counts[ids].min()) >= int(outside.max())  # the most frequent
    assert bool(small.t2d[ids].all()) and int(small.t2d.sum()) == 16

    # Widened from the first head (its MLP twice the target's) and trained for a time budget.
    wide, width = tmp_path / "wide", 2 * target.model.config.intermediate_size
    command = [sys.executable, "tools/train_eagle3.py", str(target.path), str(wide), "--init", str(out)]
    command += ["--time-budget", "2", "--intermediate-size", str(width), "--unroll", "3", "--seq-len", "40"]
    command += ["--prompt-len", "16", "--regenerate", "12", "--chains", "8", "--batch", "4", "--prompts", "0"]
    command += ["--data", str(tmp_path / "data.txt"), "--work", str(tmp_path / "work_wide")]
    command += ["--sampled-share", "0.5"]  # half its continuations sampled at the default temperature
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    wide_report = json.loads((wide / "training_report.json").read_text())
    assert wide_report["time_budget"] == 2 and wide_report["steps"] > 0
    assert wide_report["sampled_share"] == 0.5 and wide_report["sample_temperature"] == 0.8
    assert len(torch.load(tmp_path / "work_wide" / "sampled-0.8.pt")) == 6
    assert 2 <= wide_report["wall_seconds_this_run"] < 60
    assert load_eagle3(wide, target.model).config.intermediate_size == width


def test_a_head_widened_for_training_starts_as_the_narrower_one(pair):
    """--init with a wider --intermediate-size: the new units cannot change the output until they
    learn (their down projections start at zero), so training starts from the narrower head."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_eagle3 import widen_mlp

    target, _ = pair
    narrow = head_for(target.model, draft_vocab=8)
    wide = Eagle3Model(replace(narrow.config, intermediate_size=160), narrow.taps)
    wide.load_state_dict(widen_mlp(narrow.state_dict(), wide))
    features = torch.randn(3, narrow.config.hidden_size)
    attended = torch.randn(3, narrow.config.num_heads, narrow.config.head_dim)
    torch.testing.assert_close(wide.finish(attended, features), narrow.finish(attended, features))
    assert wide.midlayer.mlp.gate_proj.weight[96:].abs().sum() > 0  # the new units can learn
    torch.testing.assert_close(wide.draft_logits(features), narrow.draft_logits(features))
    with pytest.raises(SystemExit, match="an MLP of 96 units: it can be widened to --intermediate-size, not cut to 64"):
        widen_mlp(narrow.state_dict(), Eagle3Model(replace(narrow.config, intermediate_size=64), narrow.taps))


def test_regenerated_continuations_are_the_targets_own_output_and_resume(pair, tmp_path):
    """The training data the scripts regenerate: each window followed by what the target itself
    decodes greedily, many windows decoded in step; a second call adds to the first's. Sampled
    continuations are the seed's own, and near temperature 0 the greedy ones."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_dflash import target_continuations

    target, _ = pair
    data = torch.tensor([t for prompt in PROMPTS for t in prompt] * 3)
    path = tmp_path / "greedy.pt"
    first = target_continuations(target.path, data, 5, 6, 9, path, seed=1, chunk=2)
    assert first.shape == (5, 15)
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    expected = generate(target, [row[:6].tolist() for row in first], params)
    assert [row[6:].tolist() for row in first] == [c.tokens for c in expected]
    more = target_continuations(target.path, data, 7, 6, 9, path, seed=1, chunk=4)
    assert more.shape == (7, 15) and torch.equal(more[:5], first)

    sampled = [target_continuations(target.path, data, 5, 6, 9, tmp_path / f"{i}.pt", 1, temperature=1.0) for i in "ab"]
    assert torch.equal(sampled[0], sampled[1]) and torch.equal(sampled[0][:, :6], first[:, :6])
    assert not torch.equal(sampled[0], first)
    cold = target_continuations(target.path, data, 5, 6, 9, tmp_path / "cold.pt", 1, temperature=1e-4)
    assert torch.equal(cold, first)


def test_training_files_leave_out_the_folders_named(tmp_path):
    """--exclude: a package's vendored copies of other packages stay out of the training data."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_dflash import text_files

    for name in ("pkg/a.py", "pkg/_vendor/b.py", "pkg/sub/tests/c.py", "pkg/sub/d.py", "pkg/notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    names = lambda files: sorted(str(f.relative_to(tmp_path)) for f in files)  # noqa: E731
    assert names(text_files([tmp_path / "pkg"], ("_vendor", "tests"))) == ["pkg/a.py", "pkg/sub/d.py"]
    assert len(text_files([tmp_path / "pkg"])) == 4
    assert names(text_files([tmp_path / "pkg" / "_vendor"], ("_vendor",))) == ["pkg/_vendor/b.py"]  # named itself


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="training on CUDA needs a CUDA device")


@needs_cuda
def test_the_training_loss_on_cuda_is_the_cpus(pair):
    """tools/train_eagle3.py --device cuda: the same chain starts give the same loss and gradients
    as on the CPU (every tensor the loss builds lives on the head's device)."""
    from engine.checkpoint import load_checkpoint

    sys.path.insert(0, str(ROOT / "tools"))
    from train_eagle3 import ttt_loss

    target, _ = pair
    on_cuda = load_checkpoint(target.path, "cuda", "float32", native_forward=False).model
    on_cpu = load_checkpoint(target.path, "cpu", "float32", native_forward=False).model
    tokens = torch.tensor([(p * 16)[:32] for p in PROMPTS])
    losses, grads = [], []
    for model, device in ((on_cpu, "cpu"), (on_cuda, "cuda")):
        head = head_for(target.model, draft_vocab=8).to(device).train().requires_grad_(True)
        loss, steps = ttt_loss(head, model, tokens.to(device), 6, 3, 0.8, torch.Generator().manual_seed(0), 2, 0.2)
        loss.backward()
        losses.append((loss.item(), steps))
        grads.append(head.fc.weight.grad.cpu())
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-3)
    assert losses[0][1] == pytest.approx(losses[1][1], rel=1e-3)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-5)


def test_kept_target_outputs_are_the_targets_and_a_run_on_them_trains(pair, tmp_path):
    """--keep-outputs: the taps and distributions kept once (by the target as served) are the
    ones the target gives on PyTorch operators, each position's most likely draft id first; a run
    trains on them (its loss falls), and the same command again reads them back rather than
    running the target over every sequence a second time."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_dflash import kept_outputs
    from train_eagle3 import dense_log_p, target_outputs

    target, _ = pair
    head = head_for(target.model, draft_vocab=32)
    tokens = torch.tensor([(p * 12)[:24] for p in PROMPTS[:5]])
    taps, best_ids, best_log_p = kept_outputs(
        target.path, tokens, head.taps, tmp_path / "kept", "cpu", head.draft_to_target(), 8, chunk=2
    )
    assert best_ids is not None and best_log_p is not None
    want_taps, want_log_p = target_outputs(head, target.model, tokens)
    assert taps.dtype == torch.bfloat16 and taps.shape == want_taps.shape
    torch.testing.assert_close(taps.float(), want_taps, rtol=2e-2, atol=2e-2)
    assert torch.equal(best_ids[..., 0].long(), want_log_p.argmax(-1))
    torch.testing.assert_close(best_log_p.float(), want_log_p.gather(-1, best_ids.long()), rtol=1e-2, atol=1e-2)
    dense = dense_log_p(best_ids, best_log_p, 32)
    assert torch.equal(dense.argmax(-1), want_log_p.argmax(-1))
    torch.testing.assert_close(dense.exp().sum(-1), torch.ones(dense.shape[:-1]))
    assert len(list((tmp_path / "kept").glob("part-*.pt"))) == 1

    import random

    rng = random.Random(5)
    (tmp_path / "data.txt").write_text(" ".join(f"w{rng.randrange(2, 40)}" for _ in range(400)))
    out = tmp_path / "head"
    command = [sys.executable, "tools/train_eagle3.py", str(target.path), str(out), "--steps", "60", "--unroll", "3"]
    command += ["--seq-len", "40", "--prompt-len", "16", "--regenerate", "12", "--chains", "8", "--batch", "4"]
    command += ["--lr", "3e-3", "--data", str(tmp_path / "data.txt"), "--prompts", "0", "--draft-vocab", "24"]
    command += ["--work", str(tmp_path / "work"), "--keep-outputs", "6"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "target outputs kept for 12/12 sequences" in done.stderr
    report = json.loads((out / "training_report.json").read_text())
    assert report["kept_outputs_top"] == 6 and report["last_loss"] < 0.6 * report["first_loss"]
    (tmp_path / "work" / "state.pt").unlink()  # train again from the start, on what was kept
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "target outputs kept" not in again.stderr

    refused = subprocess.run(
        [*command[:2], str(target.path), str(out), "--keep-outputs", "4"], cwd=ROOT, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "--keep-outputs needs --regenerate" in refused.stderr
