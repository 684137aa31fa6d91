"""DFlash checkpoints: their taps, saved and loaded, every mismatch with the target named; the
config, the daemon and the benches taking the drafter they name."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.drafters.dflash import DFlashDrafter, HybridDFlashDrafter
from engine.model.config import CheckpointError, DFlashConfig
from engine.model.dflash import DFlashModel, default_taps, load_dflash, save_dflash
from tests.test_dflash import BLOCK, assert_serves_losslessly, dflash_for
from tests.test_speculative import MAX_SEQ_LEN


def test_taps_spread_from_layer_1_to_l_minus_3():
    assert default_taps(8, 2) == (1, 5) and default_taps(8, 3) == (1, 3, 5)
    assert default_taps(36, 5) == (1, 9, 17, 25, 33)
    assert all(0 <= t < 2 for t in default_taps(2, 2))  # a tiny target: every tap inside it


def test_checkpoint_round_trip_and_every_mismatch_named(pair, tmp_path):
    target, _ = pair
    model = dflash_for(target.model)
    save_dflash(model, tmp_path / "dflash")
    raw = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert raw["block_size"] == BLOCK and raw["dflash_config"]["target_layer_ids"] == list(
        model.config.target_layer_ids
    )
    loaded = load_dflash(tmp_path / "dflash", target.model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name])

    def broken(name: str, edit) -> str:
        bad = tmp_path / name
        save_dflash(model, bad)
        edited = json.loads(json.dumps(raw))
        edit(edited)
        (bad / "config.json").write_text(json.dumps(edited))
        with pytest.raises(CheckpointError) as caught:
            load_dflash(bad, target.model)
        return str(caught.value)

    assert "hidden size 32" in broken("hidden", lambda c: c.update(hidden_size=32))
    assert "vocabulary of 10" in broken("vocab", lambda c: c.update(vocab_size=10))
    assert "taps [7] outside" in broken("taps", lambda c: c["dflash_config"].update(target_layer_ids=[0, 7]))
    assert "mask token id 999" in broken("mask", lambda c: c["dflash_config"].update(mask_token_id=999))
    assert "not a DFlash config (no 'dflash_config')" in broken("plain", lambda c: c.pop("dflash_config"))
    eagle3 = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    assert "an EAGLE-3 head's config" in broken("eagle3", lambda c: c.pop("dflash_config") and c.update(eagle3))
    assert "draft vocabulary of 100000" in broken("draft vocab", lambda c: c.update(draft_vocab_size=100000))
    assert "sliding_window must be a whole number of positions >= 1 or null, got -1" in broken(
        "window", lambda c: c.update(sliding_window=-1)
    )
    assert "sliding window 5, shorter than its block of 6" in broken("narrow", lambda c: c.update(sliding_window=5))
    assert "sliding_window" not in raw
    save_dflash(dflash_for(target.model, window=256), tmp_path / "windowed")
    assert load_dflash(tmp_path / "windowed", target.model).config.sliding_window == 256

    small = dflash_for(target.model, draft_vocab=30, short_blocks=True)
    save_dflash(small, tmp_path / "small")
    raw_small = json.loads((tmp_path / "small" / "config.json").read_text())
    assert raw_small["draft_vocab_size"] == 30 and raw_small["dflash_config"]["short_blocks"] is True
    loaded = load_dflash(tmp_path / "small", target.model)
    assert torch.equal(loaded.draft_to_target(), small.draft_to_target()) and loaded.config.short_blocks
    assert not load_dflash(tmp_path / "dflash", target.model).config.short_blocks
    small.d2t[-1] = target.model.config.vocab_size  # maps its last draft id past the vocabulary
    save_dflash(small, tmp_path / "bad map")
    with pytest.raises(CheckpointError, match="d2t maps draft ids outside the vocabulary"):
        load_dflash(tmp_path / "bad map", target.model)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_dflash(tmp_path / "nowhere", target.model)


@pytest.mark.parametrize("kind", ["dflash", "hybrid_dflash"])
def test_the_config_the_daemon_and_the_benches_take_the_dflash_drafter(pair, tmp_path, kind):
    from control.assemble import build_controller, load_models
    from control.issues import ConfigError
    from control.load import load_config
    from engine.controller import Controller

    target, _ = pair
    save_dflash(dflash_for(target.model), tmp_path / "dflash")
    config = tmp_path / "config.toml"
    config.write_text(
        f'[engine]\ntarget = "{target.path}"\ndrafter = "{kind}"\ndflash = "dflash"\nmax_seq_len = {MAX_SEQ_LEN}\n'
        "[adaptive]\ncandidate_k = [0, 2, 5]\n"
    )
    snapshot = load_config(config, check_models=True)
    controller: Controller = build_controller(snapshot, load_models(snapshot), max_batch_size=2)
    drafter = controller.engine.drafter
    assert isinstance(drafter, DFlashDrafter) and isinstance(drafter, HybridDFlashDrafter) == (kind == "hybrid_dflash")
    assert_serves_losslessly(controller, target)

    other = dflash_for(target.model)
    wrong = DFlashModel(DFlashConfig(**{**other.config.__dict__, "hidden_size": 32}))
    save_dflash(wrong, tmp_path / "wrong")
    config.write_text(config.read_text().replace('dflash = "dflash"', 'dflash = "wrong"'))
    with pytest.raises(ConfigError, match="engine.dflash: .*does not fit the target: hidden size 32"):
        load_config(config, check_models=True)


def bench_modes_naming(kind: str, target, folder):
    """The bench's static:2 mode over a config serving drafter `kind` from folder/"ours", and the
    same mode with `+KIND=folder/other`; a mode naming a folder with no drafter is refused by name.
    Both drafters must be saved there already."""
    from bench import spec
    from control.assemble import load_models
    from control.load import load_config

    config = folder / "config.toml"
    config.write_text(
        f'[engine]\ntarget = "{target.path}"\ndrafter = "{kind}"\n{kind} = "ours"\nmax_seq_len = {MAX_SEQ_LEN}\n'
    )
    snapshot = load_config(config, check_models=True)
    models = load_models(snapshot)
    ours = spec.build_controller("static:2", snapshot, models, 1, MAX_SEQ_LEN)
    theirs = spec.build_controller(f"static:2+{kind}={folder / 'other'}", snapshot, models, 1, MAX_SEQ_LEN)
    nowhere = f"static:2+{kind}={folder / 'nowhere'}"
    with pytest.raises(SystemExit, match=f"mode '{re.escape(nowhere)}': .*nowhere: no such directory"):
        spec.build_controller(nowhere, snapshot, models, 1, MAX_SEQ_LEN)
    with pytest.raises(SystemExit, match="mode 'static:99': draft length 99 is outside 0..32"):
        spec.build_controller("static:99", snapshot, models, 1, MAX_SEQ_LEN)
    return ours, theirs


def test_a_bench_mode_serves_the_dflash_drafter_it_names(pair, tmp_path):
    """`+dflash=PATH` in a bench mode: that drafter drafts in place of the config's, on the same
    loaded target, so two drafters are compared side by side; a path with none is named."""
    target, _ = pair
    save_dflash(dflash_for(target.model), tmp_path / "ours")
    save_dflash(dflash_for(target.model, seed=1, window=7), tmp_path / "other")
    ours, theirs = bench_modes_naming("dflash", target, tmp_path)
    assert ours.engine.drafter.config.sliding_window is None
    assert theirs.engine.drafter.config.sliding_window == 7
    assert_serves_losslessly(theirs, target)
