"""EAGLE-3 checkpoints: the default taps, the SpecForge and speculators layouts loaded and
checked, saved and loaded, every mismatch with the target named; the config, the daemon and the
benches taking the head they name."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core import Engine
from engine.drafters.eagle3 import Eagle3Drafter, HybridEagle3Drafter
from engine.generate import generate
from engine.model.config import CheckpointError, Eagle3Config, ModelConfig, eagle3_taps
from engine.model.eagle3 import Eagle3Model, load_eagle3, save_eagle3
from engine.request import Request
from engine.sampling import SamplingParams
from tests.test_dflash import assert_serves_losslessly
from tests.test_dflash_checkpoints import bench_modes_naming
from tests.test_eagle3 import head_for, windowed
from tests.test_speculative import MAX_SEQ_LEN, PROMPTS


def test_sglang_default_taps_are_the_outputs_before_layers_2_l_half_and_l_minus_3():
    target = ModelConfig("llama", 64, 64, 96, num_layers=32, num_heads=4, num_kv_heads=2, head_dim=16)
    config = Eagle3Config(64, 4, 2, 16, 96, 64, 64, 64, target_layer_ids=None)
    assert eagle3_taps(config, target) == (1, 15, 28)
    assert eagle3_taps(replace(config, target_layer_ids=(2, 3, 4)), target) == (2, 3, 4)


def published_head(model: Eagle3Model, path, **config) -> None:
    """`model` written as SpecForge writes a head: bfloat16 weights, its config keys, the taps
    under eagle_config, the target's embedding carried along, d2t and t2d beside the weights."""
    save_eagle3(model, path, torch.bfloat16)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("target", None)
    raw.update({"transformers_version": "4.51.0", "use_cache": True}, **config)
    (path / "config.json").write_text(json.dumps(raw))
    state = load_file(str(path / "model.safetensors"))
    state["embed_tokens.weight"] = torch.zeros(model.config.vocab_size, model.config.hidden_size, dtype=torch.bfloat16)
    save_file(state, str(path / "model.safetensors"))


def test_a_head_in_the_published_layout_loads_and_drafts_what_it_did(pair, tmp_path):
    target, _ = pair
    model = head_for(target.model, draft_vocab=24, taps=(0, 1, 1))
    published_head(model, tmp_path / "head")
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 24
    assert raw["torch_dtype"] == "bfloat16"
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    names = set(load_file(str(tmp_path / "head" / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "d2t", "t2d"} <= names

    loaded = load_eagle3(tmp_path / "head", target.model)
    assert loaded.taps == (0, 1, 1) and torch.equal(loaded.d2t, model.d2t) and loaded.d2t.dtype == torch.long
    feature = torch.randn(3, target.model.config.hidden_size)
    with torch.no_grad():
        expected = model.logits(feature).argmax(-1)
        assert torch.equal(loaded.logits(feature).argmax(-1), expected)  # bfloat16 weights, the same choices
        assert bool(loaded.t2d[expected].all())

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = Engine(target, Eagle3Drafter(loaded, target.model, 2, MAX_SEQ_LEN), 2, MAX_SEQ_LEN, [3])
    requests = [Request(tuple(p), params) for p in PROMPTS[:2]]
    outputs = engine.run_until_done(requests, 3)
    assert [outputs[r.id] for r in requests] == [c.tokens for c in generate(target, PROMPTS[:2], params)]


def speculators_head(model: Eagle3Model, path, **config) -> None:
    """`model` written in vLLM's speculators layout: the layer's Llama config nested, tap ids
    counted as layer inputs, the decoder layer's weights under layers.0, the embedding carried."""
    c = model.config
    save_eagle3(model, path, torch.bfloat16)
    raw = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.2.0",
        "transformer_layer_config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size,
            "vocab_size": c.vocab_size,
            "num_hidden_layers": 1,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope.theta,
            "max_position_embeddings": 4096,
        },
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": [t + 1 for t in model.taps],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]},
        },
        **config,
    }
    (path / "config.json").write_text(json.dumps(raw))
    state = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    state["embed_tokens.weight"] = torch.zeros(c.vocab_size, c.hidden_size, dtype=torch.bfloat16)
    save_file(state, str(path / "model.safetensors"))


def test_a_head_in_the_speculators_layout_loads_drafts_what_it_did_and_serves_losslessly(pair, tmp_path):
    """vLLM's layout: the residual from the normed feature, tap ids one past the layers read."""
    target, _ = pair
    model = head_for(target.model, draft_vocab=24, taps=(0, 1, 1), norm_before_residual=True)
    speculators_head(model, tmp_path / "head")
    assert "layers.0.self_attn.q_proj.weight" in load_file(str(tmp_path / "head" / "model.safetensors"))
    loaded = load_eagle3(tmp_path / "head", target.model)
    assert loaded.taps == (0, 1, 1) and loaded.config.norm_before_residual and loaded.config.target == "tiny-target"
    assert torch.equal(loaded.d2t, model.d2t)
    feature, attended = torch.randn(3, target.model.config.hidden_size), torch.randn(3, 4, 16)
    with torch.no_grad():
        expected = model.logits(model.finish(attended, feature))
        assert torch.equal(loaded.logits(loaded.finish(attended, feature)).argmax(-1), expected.argmax(-1))
        # The flag is honoured: the same weights with the residual from the raw feature differ.
        model.config = replace(model.config, norm_before_residual=False)
        assert not torch.allclose(model.logits(model.finish(attended, feature)), expected)

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = Engine(target, Eagle3Drafter(loaded, target.model, 2, MAX_SEQ_LEN), 2, MAX_SEQ_LEN, [3])
    requests = [Request(tuple(p), params) for p in PROMPTS[:2]]
    outputs = engine.run_until_done(requests, 3)
    assert [outputs[r.id] for r in requests] == [c.tokens for c in generate(target, PROMPTS[:2], params)]

    # Saved again, it keeps its residual convention in the SpecForge layout.
    save_eagle3(loaded, tmp_path / "again")
    assert load_eagle3(tmp_path / "again", target.model).config.norm_before_residual


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"speculators_model_type": "medusa"}, "type 'medusa'; only eagle3 heads load"),
        ({"transformer_layer_config": None}, "needs a transformer_layer_config"),
        ({"norm_before_fc": True}, "norm_before_fc"),
        ({"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, "0 is the embedding"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}, "taps [8] outside the target's layers"),
        ({"draft_vocab_size": 500}, "draft vocabulary of 500"),
    ],
)
def test_a_speculators_head_that_does_not_fit_is_refused_by_name(pair, tmp_path, edit, named):
    target, _ = pair
    speculators_head(head_for(target.model, draft_vocab=24, taps=(0, 1, 1)), tmp_path / "head", **edit)
    with pytest.raises(CheckpointError, match=re.escape(named)):
        load_eagle3(tmp_path / "head", target.model)


def test_checkpoint_round_trip_and_every_mismatch_named(pair, tmp_path):
    target, _ = pair
    model = head_for(target.model)
    save_eagle3(model, tmp_path / "head")
    loaded = load_eagle3(tmp_path / "head", target.model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name])
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert "sliding_window" not in raw  # attends to every position before it
    save_eagle3(windowed(model, 256), tmp_path / "windowed")
    assert load_eagle3(tmp_path / "windowed", target.model).config.sliding_window == 256
    unused = json.loads((tmp_path / "windowed" / "config.json").read_text()) | {"use_sliding_window": False}
    (tmp_path / "windowed" / "config.json").write_text(json.dumps(unused))  # as Qwen configs carry one
    assert load_eagle3(tmp_path / "windowed", target.model).config.sliding_window is None

    def broken(name: str, edit, weights=None) -> str:
        bad = tmp_path / name
        save_eagle3(model, bad)
        edited = json.loads(json.dumps(raw))
        edit(edited)
        (bad / "config.json").write_text(json.dumps(edited))
        if weights:
            state = load_file(str(bad / "model.safetensors"))
            weights(state)
            save_file(state, str(bad / "model.safetensors"))
        with pytest.raises(CheckpointError) as caught:
            load_eagle3(bad, target.model)
        return str(caught.value)

    assert "hidden size 32" in broken("hidden", lambda c: c.update(target_hidden_size=32))
    assert "vocabulary of 10" in broken("vocab", lambda c: c.update(vocab_size=10))
    taps = {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}
    assert "taps [7] outside" in broken("taps", lambda c: c.update(eagle_config=taps))
    assert "three" in broken("two", lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1]}))
    assert "one decoder layer" in broken("layers", lambda c: c.update(num_hidden_layers=2))
    assert "not an EAGLE-3 head (architectures ['DFlashDraftModel'])" in broken(
        "dflash", lambda c: c.update(architectures=["DFlashDraftModel"])
    )
    assert "not an EAGLE-3 config" in broken("plain", lambda c: c.pop("hidden_size"))
    for window in (-4, 2.5, "256", True):
        assert f"sliding_window must be a whole number of positions >= 1 or null, got {window!r}" in broken(
            "window", lambda c, window=window: c.update(sliding_window=window)
        )
    assert "missing ['fc.weight']" in broken("fc", lambda c: None, lambda s: s.pop("fc.weight"))
    assert "q_proj.weight has shape" in broken(
        "shape", lambda c: None, lambda s: s.update({"midlayer.self_attn.q_proj.weight": torch.zeros(3, 3)})
    )
    reduced = tmp_path / "reduced"
    published_head(head_for(target.model, draft_vocab=8), reduced)
    state = load_file(str(reduced / "model.safetensors"))
    state["d2t"] = state["d2t"] + 1000
    save_file(state, str(reduced / "model.safetensors"))
    with pytest.raises(CheckpointError, match="d2t maps draft ids outside the vocabulary"):
        load_eagle3(reduced, target.model)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_eagle3(tmp_path / "nowhere", target.model)


@pytest.mark.parametrize("kind", ["eagle3", "hybrid_eagle3"])
def test_the_config_the_daemon_and_the_benches_take_the_eagle3_drafter(pair, tmp_path, kind):
    from control.assemble import build_controller, load_models
    from control.issues import ConfigError
    from control.load import load_config

    target, _ = pair
    save_eagle3(head_for(target.model), tmp_path / "head")
    config = tmp_path / "config.toml"
    config.write_text(
        f'[engine]\ntarget = "{target.path}"\ndrafter = "{kind}"\neagle3 = "head"\nmax_seq_len = {MAX_SEQ_LEN}\n'
        "[adaptive]\ncandidate_k = [0, 2, 5]\n"
    )
    snapshot = load_config(config, check_models=True)
    controller = build_controller(snapshot, load_models(snapshot), max_batch_size=2)
    drafter = controller.engine.drafter
    assert isinstance(drafter, Eagle3Drafter) and isinstance(drafter, HybridEagle3Drafter) == (kind == "hybrid_eagle3")
    assert_serves_losslessly(controller, target)
    assert sum(state.stats.drafts_proposed for state in controller.engine.states.values()) > 0

    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps({**raw, "vocab_size": 10}))
    with pytest.raises(ConfigError, match="engine.eagle3: .*does not fit the target: vocabulary of 10"):
        load_config(config, check_models=True)
    # A config its weights do not match: found from their file's header, before anything loads.
    heads = raw["num_attention_heads"] - 1
    (tmp_path / "head" / "config.json").write_text(json.dumps({**raw, "num_attention_heads": heads}))
    with pytest.raises(
        ConfigError, match=r"engine.eagle3: .*model\.safetensors: midlayer\.self_attn\.\w+_proj\.weight has shape"
    ):
        load_config(config, check_models=True)
    (tmp_path / "head" / "config.json").write_text(json.dumps(raw))
    (tmp_path / "head" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"engine.eagle3: .*model\.safetensors: not a readable safetensors file"):
        load_config(config, check_models=True)


def test_a_bench_mode_serves_the_eagle3_head_it_names(pair, tmp_path):
    """`+eagle3=PATH` in a bench mode: that head drafts in place of the config's, on the same
    loaded target, so two heads are compared side by side; a path with no head is named."""
    target, _ = pair
    save_eagle3(head_for(target.model), tmp_path / "ours")
    save_eagle3(head_for(target.model, draft_vocab=8, seed=1), tmp_path / "other")
    ours, theirs = bench_modes_naming("eagle3", target, tmp_path)
    assert ours.engine.drafter.model.config.draft_vocab_size == target.model.config.vocab_size
    assert theirs.engine.drafter.model.config.draft_vocab_size == 8
    assert_serves_losslessly(theirs, target)
