"""tools/train_dflash.py: its loss falls, a drafter it deepens starts as the shallower one, and
on the target's own greedy continuations it learns them."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine.drafters.dflash import DFlashDrafter
from engine.generate import generate
from engine.model.dflash import load_dflash
from engine.request import Request, Sequence
from engine.sampling import SamplingParams
from tests.test_speculative import MAX_SEQ_LEN, PROMPTS


def test_the_training_script_runs_end_to_end_and_its_loss_falls(pair, tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    target, _ = pair
    rng = random.Random(0)
    words = [f"w{rng.randrange(2, 40)}" for _ in range(60)]
    (tmp_path / "data.txt").write_text(" ".join(words * 40))  # repetitive: learnable in a few steps
    out = tmp_path / "dflash"
    command = [sys.executable, "tools/train_dflash.py", str(target.path), str(out), "--steps", "60"]
    command += ["--block", "4", "--seq-len", "48", "--anchors", "8", "--batch", "4", "--lr", "3e-3"]
    command += ["--data", str(tmp_path / "data.txt"), "--prompts", "0"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "training_report.json").read_text())
    assert report["last_loss"] < 0.6 * report["first_loss"]  # KL from the target's distribution
    trained = load_dflash(out, target.model).config
    assert trained.block_size == 4 and trained.sliding_window == 48  # no further back than it trained on
    resumed = subprocess.run(command[:-2] + ["--prompts", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "resuming at step 60" in resumed.stderr


def test_a_drafter_deepened_by_the_training_script_starts_by_drafting_what_it_deepened(pair, tmp_path):
    """--init with a shallower drafter and more --layers: the added layer starts as the identity,
    so before any step the deeper drafter's logits are the shallower one's; --save-dtype bfloat16
    writes half the bytes, and the loader runs them in float32."""
    import subprocess
    import sys

    from safetensors import safe_open

    from tests.conftest import ROOT

    target, _ = pair
    (tmp_path / "data.txt").write_text(" ".join(f"w{i % 37}" for i in range(400)))
    command = [sys.executable, "tools/train_dflash.py", str(target.path), str(tmp_path / "shallow"), "--steps", "0"]
    command += ["--block", "4", "--seq-len", "48", "--data", str(tmp_path / "data.txt"), "--prompts", "0"]
    command += ["--work", str(tmp_path / "work"), "--save-dtype", "bfloat16"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)  # 2 layers, at random
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "deep"
    command[3] = str(out)
    command += ["--layers", "3", "--init", str(tmp_path / "shallow")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert weights.get_tensor("layers.2.q_proj.weight").dtype == torch.bfloat16
    deep, before = load_dflash(out, target.model), load_dflash(tmp_path / "shallow", target.model)
    assert deep.config.num_layers == 3 and deep.fc.weight.dtype == torch.float32
    outputs = []
    for model in (before, deep):
        drafter = DFlashDrafter(model, target.model, 1, MAX_SEQ_LEN)
        seq = Sequence(Request(tuple(PROMPTS[0])), slot=0, generator=None, tokens=list(PROMPTS[0]))
        cache = target.model.new_cache(1, MAX_SEQ_LEN)
        batch = target.model.batch(cache, [cache.allocate()], [PROMPTS[0][:-1]])
        drafter.admit([seq], target.model(batch, cache, capture=drafter.capture_layers).hidden)
        block = torch.full((1, 4), model.config.mask_token_id)
        block[0, 0] = seq.tokens[-1]
        outputs.append(drafter.block_logits([seq.draft_slot], block, 3))
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5)

    command[command.index("--init") + 1] = str(out)  # deeper than --layers: refused, by name
    command[command.index("--layers") + 1] = "2"
    command[3] = str(tmp_path / "again")
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "--init has weights this drafter lacks: ['layers.2." in refused.stderr


@pytest.mark.parametrize("draft_vocab, short_blocks, keep", [(0, 0.0, False), (24, 0.5, True)])
def test_the_training_script_learns_the_targets_own_greedy_continuations(
    pair, tmp_path, draft_vocab, short_blocks, keep
):
    """With --regenerate the data is the target's own greedy output after training-text prompts
    (what a drafter meets when the target serves greedily), and the drafter learns it, over the
    whole vocabulary or over --draft-vocab's most frequent ids, on whole blocks or on shorter ones
    too, with the target's taps computed every step or once and kept (--keep-outputs)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    target, _ = pair
    rng = random.Random(1)
    (tmp_path / "data.txt").write_text(" ".join(f"w{rng.randrange(2, 40)}" for _ in range(400)))
    out, work = tmp_path / "dflash", tmp_path / "work"
    command = [sys.executable, "tools/train_dflash.py", str(target.path), str(out), "--steps", "60", "--block", "4"]
    command += ["--seq-len", "40", "--prompt-len", "16", "--regenerate", "12", "--anchors", "8", "--batch", "4"]
    command += ["--lr", "3e-3", "--data", str(tmp_path / "data.txt"), "--prompts", "0", "--work", str(work)]
    command += ["--draft-vocab", str(draft_vocab), "--short-blocks", str(short_blocks)]
    command += ["--keep-outputs"] if keep else []
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("target outputs kept for 12/12 sequences" in done.stderr) == keep
    sequences = torch.load(work / "greedy.pt")
    drafter = load_dflash(out, target.model)
    assert drafter.config.short_blocks == (short_blocks > 0)
    if draft_vocab:  # the most frequent ids of the sequences
        counts = torch.bincount(sequences.flatten(), minlength=target.model.config.vocab_size)
        assert drafter.config.draft_vocab_size == draft_vocab
        assert counts[drafter.draft_to_target()].min() >= counts.sort(descending=True).values[draft_vocab - 1]
    assert sequences.shape == (12, 40)
    prompts = sequences[:, :16].tolist()
    continuations = generate(target, prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [c.tokens for c in continuations] == sequences[:, 16:].tolist()
    report = json.loads((out / "training_report.json").read_text())
    assert report["regenerated_sequences"] == 12 and report["kept_outputs"] == keep
    assert report["last_loss"] < 0.6 * report["first_loss"]  # cross-entropy on the target's greedy tokens
    if keep:  # again, for a time budget, from what was kept (no target forward over the sequences)
        budget = [*command[:4], "--time-budget", "2", *command[6:], "--work", str(tmp_path / "work2")]
        (tmp_path / "work2").mkdir()
        (tmp_path / "work2" / "greedy.pt").write_bytes((work / "greedy.pt").read_bytes())
        kept = next(work.glob("outputs-*"))
        (tmp_path / "work2" / kept.name).symlink_to(kept)
        done = subprocess.run(budget, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "target outputs kept" not in done.stderr and "regenerated" not in done.stderr
        report = json.loads((out / "training_report.json").read_text())
        assert report["time_budget"] == 2 and report["steps"] > 0 and 2 <= report["wall_seconds_this_run"] < 60
