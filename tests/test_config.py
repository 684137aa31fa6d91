"""The config layer: schema, validation (every error at once), snapshots, diff and effective values."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import tomllib

from control.issues import ConfigError, ConfigIssue
from control.load import load_config, parse_config
from control.schema import DEFAULT_CANDIDATES, SCHEMA, SLOT_KEYS, key_at, key_paths, policy_params
from control.settings import AdaptiveSettings
from control.snapshot import ConfigSnapshot, diff, effective
from control.values import check_value
from engine.policy import STRATEGY_NAMES, BatchSlot, PolicyParams
from engine.policy.slots import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "config.toml"
DEFAULTS_ONLY = "# every key at its default\n"  # an empty file is an error


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def issues_of(tmp_path: Path, text: str) -> dict[str, str]:
    """path -> message of every issue a file has (it must have some)."""
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text))
    return {issue.path: issue.message for issue in caught.value.issues}


# --- the shipped file ---------------------------------------------------------------------------


def test_shipped_config_parses_and_holds_the_defaults():
    shipped = load_config(SHIPPED)
    defaults = parse_config(DEFAULTS_ONLY, path=SHIPPED)
    assert effective(shipped) == {
        path: {**entry, "source": shipped.sources[path]} for path, entry in effective(defaults).items()
    }
    assert shipped.engine.target == ROOT / "models" / "target"


@dataclasses.dataclass(frozen=True)
class Written:
    """A `key = value` line of config.toml, commented out or not."""

    value: object  # as TOML reads it
    commented: bool
    comment: str  # the comment lines right above it, joined, or the one beside it


def written_keys(text: str) -> dict[str, Written]:
    """Every key a config file writes, by path ("adaptive.slots[0].candidate_k" for a slot's). A
    line counts where it reads as TOML once uncommented; a commented-out [[adaptive.slots]]
    opens a slot, as it would uncommented."""
    lines = text.splitlines()
    found: dict[str, Written] = {}
    table = ""
    slots = 0
    for i, line in enumerate(lines):
        if re.fullmatch(r"\[([a-z_]+)\].*", line):
            table = line[1 : line.index("]")]
            continue
        if re.fullmatch(r"#\s*\[\[adaptive\.slots\]\]", line):
            table, slots = f"adaptive.slots[{slots}]", slots + 1
            continue
        line_key = re.fullmatch(r"(#\s*)?([a-z_][a-z0-9_]*\s*=.*)", line)
        if not table or not line_key:
            continue
        try:
            ((name, value),) = tomllib.loads(line_key[2]).items()
        except tomllib.TOMLDecodeError:
            continue  # prose, such as "# 1 = no backoff."
        above = []
        while i - 1 - len(above) >= 0 and lines[i - 1 - len(above)].startswith("#"):
            above.append(lines[i - 1 - len(above)].lstrip("# "))
        beside = line.split("#", 2)[-1] if line.count("#") > bool(line_key[1]) else ""
        found[f"{table}.{name}"] = Written(value, bool(line_key[1]), " ".join(reversed(above)) or beside)
    return found


SHIPPED_KEYS = written_keys(SHIPPED.read_text())

# The values config.toml writes that are not the schema's default: each an example of a key whose
# default is to leave it unset.
EXAMPLES = {
    "adaptive.initial_k": "unset, each strategy starts at its own k",
    "admin.group": "unset, the daemon's own group",
    "server.model_name": "unset, the target directory's name (which the example shows)",
    "server.api_key": "unset, an open API",
    "server.api_key_file": "unset, an open API",
    "adaptive.slots[0].min_batch_size": "no slots",
    "adaptive.slots[0].candidate_k": "no slots",
}


def test_config_toml_writes_only_schema_keys_each_with_a_valid_value():
    for path, written in SHIPPED_KEYS.items():
        section, name = path.split(".", 1)
        assert section in SCHEMA and (name in SCHEMA[section].keys or name.startswith("slots[")), path
        check_value(key_at(path), written.value)  # raises InvalidValue naming what is wrong


def test_config_toml_documents_every_schema_key():
    paths = {path for path in key_paths() if key_at(path).kind != "slots"}
    paths |= {f"adaptive.slots[0].{name}" for name in SLOT_KEYS}
    assert paths == set(SHIPPED_KEYS)
    for path in paths:
        assert SHIPPED_KEYS[path].comment, f"{path} has no comment above or beside it"


def test_config_toml_comments_out_exactly_the_keys_without_a_fixed_default():
    """As its header says: a key left out takes the default shown, a commented-out one has none."""
    for path, written in SHIPPED_KEYS.items():
        default = key_at(path).default
        assert written.commented == (default is None or callable(default)), path


def test_every_value_config_toml_writes_is_the_default_but_its_examples(monkeypatch):
    # The socket's default as systemd's RuntimeDirectory=adaspec (systemd/adaspecd.service) has it.
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/adaspec")
    defaults = parse_config(DEFAULTS_ONLY, path=SHIPPED)
    differ = set()
    for path, written in SHIPPED_KEYS.items():
        key = key_at(path)
        value = check_value(key, written.value)
        if key.kind == "path":
            value = SHIPPED.parent / value
        if "[" in path or value != defaults.get(path):
            differ.add(path)
    assert differ == set(EXAMPLES)


def test_config_toml_states_the_schemas_defaults():
    """Every key with a fixed default says it in its comment ("Default X."), as the schema has it."""

    def toml(value: object) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return f'"{value}"'
        return repr(value)

    for path, written in SHIPPED_KEYS.items():
        default = key_at(path).default
        if default is not None and not callable(default):  # computed or unset: said in words
            assert f"Default {toml(default)}" in written.comment, path


def test_every_schema_key_is_a_settings_field():
    for section, spec in SCHEMA.items():
        names = {f.name for f in dataclasses.fields(spec.settings)}
        if spec.settings is AdaptiveSettings:
            names = (names - {"policy"}) | {f.name for f in dataclasses.fields(PolicyParams)}
        assert names == set(spec.keys), section


def test_the_schema_is_the_one_place_a_policy_default_is_written():
    unset = dataclasses.MISSING
    defaulted = [f.name for f in dataclasses.fields(PolicyParams) if (f.default, f.default_factory) != (unset, unset)]
    assert defaulted == []
    # Every strategy the engine runs has its default candidates here, and no other does.
    assert set(STRATEGIES) == set(STRATEGY_NAMES) == set(DEFAULT_CANDIDATES)


def test_policy_params_are_the_schemas_defaults_but_for_what_is_given():
    keys = SCHEMA["adaptive"].keys
    params = policy_params()
    assert params == parse_config(DEFAULTS_ONLY).adaptive.policy
    assert params.strategy == keys["strategy"].default and params.probe_interval == keys["probe_interval"].default
    # The candidates follow the strategy given, as in a file, unless they are given too.
    assert policy_params(strategy="ema").candidate_k == DEFAULT_CANDIDATES["ema"]
    assert policy_params(strategy="ema", candidate_k=(0, 4)).candidate_k == (0, 4)
    assert policy_params(switch_margin=0.5).switch_margin == 0.5
    with pytest.raises(ValueError, match="strategy must be one of"):
        policy_params(strategy="magic")


# --- defaults and sources -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "candidates"),
    [("measured", (0, 1, 2, 3, 4, 5, 7)), ("positional", (0, 1, 2, 3, 4, 5, 7)), ("ema", (1, 3, 7))],
)
def test_each_strategy_has_its_own_default_candidates_unless_the_file_names_them(tmp_path, strategy, candidates):
    snapshot = load_config(write(tmp_path, f'[adaptive]\nstrategy = "{strategy}"\n'))
    assert snapshot.adaptive.policy.candidate_k == candidates
    named = load_config(write(tmp_path, f'[adaptive]\nstrategy = "{strategy}"\ncandidate_steps = [0, 2]\n'))
    assert named.adaptive.policy.candidate_k == (0, 2)


def test_omitted_sections_take_defaults_and_sources_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/adaspec:/run/other")
    snapshot = load_config(write(tmp_path, "[adaptive]\nema_alpha = 0.5\n"))
    assert snapshot.adaptive.policy.ema_alpha == 0.5
    assert snapshot.sources["adaptive.ema_alpha"] == "file"
    # The daemon's defaults: the positional strategy over its own ladder (chosen on the tuning half
    # of the workload suite, docs/benchmarks.md); every policy parameter is the schema's default.
    assert snapshot.adaptive.policy == policy_params(ema_alpha=0.5)
    assert snapshot.adaptive.policy.strategy == "positional"
    assert snapshot.adaptive.policy.candidate_k == (0, 1, 2, 3, 4, 5, 7)
    assert snapshot.adaptive.enabled is True and snapshot.adaptive.initial_k is None
    assert snapshot.engine.target == tmp_path / "models" / "target"
    assert snapshot.engine.max_batch_size == 8 and snapshot.server.port == 8000
    assert snapshot.admin.socket == Path("/run/adaspec/admin.sock")
    assert snapshot.admin.mode == "0600" and snapshot.admin.group is None
    assert snapshot.shutdown.drain_timeout_s == 30.0 and snapshot.logging.format == "auto"
    assert set(snapshot.sources) == set(key_paths())
    assert {p for p, s in snapshot.sources.items() if s == "file"} == {"adaptive.ema_alpha"}


def test_socket_default_falls_back_to_xdg_then_tmp(tmp_path, monkeypatch):
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert parse_config(DEFAULTS_ONLY).admin.socket == Path("/run/user/1000/adaspec/admin.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert str(parse_config(DEFAULTS_ONLY).admin.socket).startswith("/tmp/adaspec-")


def test_explicit_paths_resolve_against_the_config_directory(tmp_path):
    text = '[engine]\ntarget = "../t"\ndraft = "/abs/d"\n[admin]\nsocket = "run/a.sock"\n'
    snapshot = load_config(write(tmp_path, text))
    assert snapshot.engine.target == tmp_path / ".." / "t"
    assert snapshot.engine.draft == Path("/abs/d")
    assert snapshot.admin.socket == tmp_path / "run" / "a.sock"


def test_group_makes_the_default_mode_group_writable(tmp_path):
    snapshot = load_config(write(tmp_path, '[admin]\ngroup = "adaspec"\n'))
    assert snapshot.admin.mode == "0660" and snapshot.admin.mode_bits == 0o660
    assert snapshot.sources["admin.mode"] == "default"
    assert load_config(write(tmp_path, '[admin]\ngroup = "adaspec"\nmode = "640"\n')).admin.mode == "0640"


def test_an_int_is_accepted_where_a_float_is_expected(tmp_path):
    snapshot = load_config(write(tmp_path, "[adaptive]\nema_alpha = 1\n[shutdown]\ndrain_timeout_s = 5\n"))
    assert snapshot.adaptive.policy.ema_alpha == 1.0 and isinstance(snapshot.adaptive.policy.ema_alpha, float)
    assert snapshot.shutdown.drain_timeout_s == 5.0


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        ("[adaptiv]\n", "adaptiv", "did you mean 'adaptive'"),
        ("[adaptive]\nema_alfa = 0.1\n", "adaptive.ema_alfa", "did you mean 'ema_alpha'"),
        ("engine = 3\n", "engine", "must be a table"),
        ("[adaptive]\nenabled = 1\n", "adaptive.enabled", "true or false"),
        ("[engine]\nmax_steps = true\n", "engine.max_k", "must be an integer, got boolean"),
        ("[engine]\nmax_steps = 4.0\n", "engine.max_k", "must be an integer, got float"),
        ("[adaptive]\nema_alpha = true\n", "adaptive.ema_alpha", "must be a number"),
        ('[adaptive]\nema_alpha = "0.2"\n', "adaptive.ema_alpha", "must be a number"),
        ("[adaptive]\nema_alpha = nan\n", "adaptive.ema_alpha", "finite"),
        ("[adaptive]\nema_alpha = 0\n", "adaptive.ema_alpha", "> 0 and <= 1"),
        ("[adaptive]\nema_alpha = 1.5\n", "adaptive.ema_alpha", "> 0 and <= 1"),
        ("[engine]\nmax_batch_size = 0\n", "engine.max_batch_size", ">= 1 and <= 256"),
        ("[engine]\nmax_seq_len = 65536\n", "engine.max_seq_len", "<= 32768"),
        ("[engine]\nmax_steps = 65\n", "engine.max_k", "<= 64"),
        ("[server]\nport = 65536\n", "server.port", ">= 0 and <= 65535"),
        ("[server]\nmax_queue = -1\n", "server.max_queue", ">= 0 and <= 100000"),
        ("[shutdown]\ndrain_timeout_s = 0\n", "shutdown.drain_timeout_s", "> 0"),
        ("[adaptive]\nupdate_interval = 0\n", "adaptive.update_interval", ">= 1"),
        ("[adaptive]\ncandidate_steps = []\n", "adaptive.candidate_k", "must not be empty"),
        ("[adaptive]\ncandidate_steps = [1, 3, 3]\n", "adaptive.candidate_k", "duplicates: 3"),
        ("[adaptive]\ncandidate_steps = [1, -1]\n", "adaptive.candidate_k", ">= 0"),
        ('[adaptive]\ncandidate_steps = [1, "3"]\n', "adaptive.candidate_k", "integers only"),
        ("[adaptive]\ncandidate_steps = 3\n", "adaptive.candidate_k", "array of integers"),
        ("[adaptive]\ncandidate_steps = [1, 33]\n", "adaptive.candidate_k", "33 above engine.max_k = 32"),
        ("[adaptive]\nstatic_steps = 33\n", "adaptive.static_k", "above engine.max_k"),
        ("[adaptive]\ninitial_steps = 33\n", "adaptive.initial_k", "above engine.max_k"),
        ("[engine]\nmax_steps = 4\n", "adaptive.candidate_k", "5, 7 above engine.max_k = 4 (the default"),
        ("[engine]\nngram_min = 5\n", "engine.ngram_min", "<= engine.ngram_max (4)"),
        ("[engine]\nngram_min = 0\n", "engine.ngram_min", ">= 1"),
        ("[engine]\nlookup_history = -1\n", "engine.lookup_history", ">= 0"),
        ('[admin]\nmode = "0800"\n', "admin.mode", "octal digits"),
        ('[admin]\nmode = "rw-rw----"\n', "admin.mode", "octal digits"),
        ('[admin]\nmode = "04755"\n', "admin.mode", "octal digits"),
        ("[admin]\nmode = 0o600\n", "admin.mode", "got the integer 384"),
        (
            '[engine]\ndrafter = "eagle"\n',
            "engine.drafter",
            "must be one of 'draft_model', 'hybrid', 'ngram', 'dflash', 'hybrid_dflash', 'eagle3', 'hybrid_eagle3', "
            "'none'",
        ),
        ('[adaptive]\nstrategy = "measure"\n', "adaptive.strategy", "did you mean 'measured'"),
        ('[adaptive]\nstrategy = "goodput"\n', "adaptive.strategy", "no longer offered: 'measured' replaced it"),
        ("[adaptive]\ndraft_cutoff = true\n", "adaptive.draft_cutoff", "no longer exists"),
        ('[engine]\ndevice = "gpu"\n', "engine.device", "'cpu', 'cuda', 'cuda:N', 'npu' or 'npu:N'"),
        ('[engine]\ndevice = "cuda:x"\n', "engine.device", "'cuda:N'"),
        ('[engine]\ndtype = "fp16"\n', "engine.dtype", "must be one of"),
        ('[engine]\nweights = "q4"\n', "engine.weights", "must be one of 'as_loaded', 'int8', 'int4'"),
        ('[engine]\nverification = "blocks"\n', "engine.verification", "did you mean 'block'"),
        ('[logging]\nlevel = "verbose"\n', "logging.level", "must be one of"),
        ('[logging]\nformat = "text"\n', "logging.format", "must be one of"),
        ('[engine]\ntarget = ""\n', "engine.target", "must not be empty"),
        ("[engine]\ndraft = 3\n", "engine.draft", "must be a string"),
        ('[server]\nhost = ""\n', "server.host", "must not be empty"),
        ("[adaptive]\nslots = 3\n", "adaptive.slots", "array of tables"),
        ("[[adaptive.slots]]\nmin_batch_size = 0\ncandidate_steps = [1]\n", "adaptive.slots[0].min_batch_size", ">= 1"),
        ("[[adaptive.slots]]\ncandidate_steps = [1]\n", "adaptive.slots[0].min_batch_size", "missing"),
        ("[[adaptive.slots]]\nmin_batch_size = 2\ncandidate = [1]\n", "adaptive.slots[0].candidate", "did you mean"),
        (
            "[[adaptive.slots]]\nmin_batch_size = 2\ncandidate_steps = []\n",
            "adaptive.slots[0].candidate_k",
            "empty",
        ),
    ],
)
def test_each_error_is_reported_with_its_key_path(tmp_path, text, path, fragment):
    issues = issues_of(tmp_path, text)
    assert path in issues, issues
    assert fragment in issues[path]


def test_explicit_max_steps_bounds_keys_only_when_it_is_valid(tmp_path):
    # An invalid max_k is reported once, not again through every k it would bound.
    assert set(issues_of(tmp_path, "[engine]\nmax_steps = 0\n")) == {"engine.max_k"}


def test_a_file_with_several_errors_reports_all_of_them(tmp_path):
    text = """
[engine]
max_k = 4
ngram_min = 3
ngram_max = 2
device = "tpu"
colour = "blue"

[adaptive]
candidate_k = [1, 3, 3]
static_k = 6
ema_alpha = 2.0
draft_confidence = 1.5

[[adaptive.slots]]
min_batch_size = 4
candidate_k = [1, 5]

[[adaptive.slots]]
min_batch_size = 4
candidate_k = [2]

[admin]
mode = "999"

[server]
port = 70000

[extra]
"""
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text))
    paths = [issue.path for issue in caught.value.issues]
    assert sorted(paths) == sorted(
        [
            "engine.ngram_min",
            "engine.device",
            "engine.colour",
            "adaptive.candidate_k",
            "adaptive.static_k",
            "adaptive.ema_alpha",
            "adaptive.draft_confidence",
            "adaptive.slots[0].candidate_k",
            "adaptive.slots[1].min_batch_size",
            "admin.mode",
            "server.port",
            "extra",
        ]
    )
    # str() lists every issue, one per line, as "path: message".
    lines = str(caught.value).splitlines()
    assert lines == [f"{issue.path}: {issue.message}" for issue in caught.value.issues]


def test_slot_errors_are_still_reported_next_to_other_slot_errors(tmp_path):
    text = """
[engine]
max_k = 4
[[adaptive.slots]]
min_batch_size = 2
candidate_k = [1, 5]
[[adaptive.slots]]
min_batch_size = 8
candidate_k = [1, 6]
"""
    issues = issues_of(tmp_path, text)
    assert issues == {
        "adaptive.slots[0].candidate_k": "5 above engine.max_k = 4",
        "adaptive.slots[1].candidate_k": "6 above engine.max_k = 4",
        "adaptive.candidate_k": "5, 7 above engine.max_k = 4 (the default; set it explicitly)",
    }


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "absent.toml")
    assert [issue.path for issue in caught.value.issues] == ["<file>"]
    assert "absent.toml" in caught.value.issues[0].message


def test_bytes_that_are_not_utf8_are_a_config_error():
    with pytest.raises(ConfigError) as caught:
        parse_config(b"[engine]\ntarget = '\xff'\n")
    assert caught.value.issues == [ConfigIssue("<file>", "not UTF-8 text (byte 19)")]


# --- snapshots ----------------------------------------------------------------------------------


def test_snapshot_metadata_and_immutability(tmp_path):
    path = write(tmp_path, "[server]\nport = 8001\n")
    first = load_config(path, generation=7)
    assert first.generation == 7 and first.path == path
    assert first.loaded_at > 0
    second = load_config(write(tmp_path, "[server]\nport = 8002\n"), generation=8)
    assert first.sha256 != second.sha256
    assert parse_config(path.read_bytes()).sha256 == parse_config(path.read_text()).sha256
    assert load_config(path).sha256 != first.sha256  # path was rewritten by the second write
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.generation = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.server.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        first.sources["server.port"] = "admin"  # type: ignore[index]


def test_sha256_is_of_the_raw_bytes(tmp_path):
    import hashlib

    raw = b"# hello\n[server]\nport = 8001\n"
    assert parse_config(raw).sha256 == hashlib.sha256(raw).hexdigest()
    assert parse_config(raw + b"\n").sha256 != parse_config(raw).sha256


def test_slots_parse_into_batch_slots():
    text = """
[adaptive]
candidate_k = [0, 1, 3, 7]
[[adaptive.slots]]
min_batch_size = 4
candidate_k = [0, 1, 3]
[[adaptive.slots]]
min_batch_size = 16
candidate_k = [0, 1]
"""
    snapshot = parse_config(text)
    assert snapshot.adaptive.policy.slots == (BatchSlot(4, (0, 1, 3)), BatchSlot(16, (0, 1)))
    assert snapshot.adaptive.policy.all_k == (0, 1, 3, 7)
    assert snapshot.sources["adaptive.slots"] == "file"
    assert effective(snapshot)["adaptive.slots"]["value"] == [
        {"min_batch_size": 4, "candidate_k": [0, 1, 3]},
        {"min_batch_size": 16, "candidate_k": [0, 1]},
    ]


def test_slot_candidate_above_max_steps_names_the_slot():
    with pytest.raises(ConfigError) as caught:
        parse_config("[[adaptive.slots]]\nmin_batch_size = 2\ncandidate_steps = [1, 33]\n")
    assert [issue.path for issue in caught.value.issues] == ["adaptive.slots[0].candidate_k"]


# --- diff and effective -------------------------------------------------------------------------


def test_diff_classifies_live_and_restart_changes():
    base = parse_config("[adaptive]\nema_alpha = 0.2\n")
    assert diff(base, parse_config(DEFAULTS_ONLY)).empty
    assert diff(base, base).empty

    live = diff(base, parse_config("[adaptive]\nema_alpha = 0.3\n"))
    assert live.live == ("adaptive.ema_alpha",) and live.restart == () and not live.empty

    restart = diff(base, parse_config("[engine]\nmax_batch_size = 16\n[logging]\nlevel = 'debug'\n"))
    assert restart.restart == ("engine.max_batch_size",)
    assert restart.live == ("logging.level",)


def test_effective_marks_admin_overrides():
    snapshot = parse_config("[adaptive]\nstrategy = 'ema'\n")
    full = effective(snapshot, {"adaptive.pinned_k": 3, "adaptive.ema_alpha": 0.5})
    table = {path: {"value": e["value"], "source": e["source"]} for path, e in full.items()}
    assert table["adaptive.strategy"] == {"value": "ema", "source": "file"}
    assert table["adaptive.candidate_k"] == {"value": [1, 3, 7], "source": "default"}  # ema's own
    assert table["adaptive.ema_alpha"] == {"value": 0.5, "source": "admin"}
    assert table["adaptive.pinned_k"] == {"value": 3, "source": "admin"}
    assert table["adaptive.initial_k"] == {"value": None, "source": "default"}
    # Each key says what it means and when an edit applies, from the one schema.
    assert full["adaptive.ema_alpha"]["applies"] == "live" and "EMA" in full["adaptive.ema_alpha"]["doc"]
    assert full["engine.max_batch_size"]["applies"] == "at restart" and full["engine.max_batch_size"]["doc"]
    assert isinstance(table["engine.target"]["value"], str)
    assert set(table) == set(key_paths()) | {"adaptive.pinned_k"}


def test_get_reads_any_key_path():
    snapshot = parse_config("[adaptive]\nenabled = false\nswitch_margin = 0.1\n")
    assert isinstance(snapshot, ConfigSnapshot)
    assert snapshot.get("adaptive.enabled") is False
    assert snapshot.get("adaptive.switch_margin") == 0.1
    with pytest.raises(KeyError):
        snapshot.get("adaptive.pinned_k")


# --- hardening: what a running daemon must never accept or echo whole ---------------------------


@pytest.mark.parametrize("text", ["", "\n", "  \n\t\n"])
def test_an_empty_file_is_an_error_not_every_default(tmp_path, text):
    """An editor that truncates before it writes, or `: > config.toml`, must not reset the
    daemon to defaults (and point its restart keys at <config dir>/models)."""
    assert issues_of(tmp_path, text) == {"<file>": "the file is empty"}


def test_model_paths_are_checked_where_they_are_read(tmp_path):
    shipped_models = ROOT / "models"
    nowhere = f'[engine]\ntarget = "{tmp_path / "nowhere"}"\ndraft = "{shipped_models / "draft"}"\n'
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, nowhere), check_models=True)
    assert [(i.path, i.message) for i in caught.value.issues] == [
        ("engine.target", f"{tmp_path / 'nowhere'}: no such directory")
    ]
    load_config(write(tmp_path, nowhere))  # not asked to: a config written before its models

    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text((shipped_models / "target" / "config.json").read_text())
    text = f'[engine]\ntarget = "{half}"\ndraft = "{shipped_models / "draft"}"\n'
    with pytest.raises(ConfigError, match="engine.target: .*missing tokenizer.json, model.safetensors or"):
        load_config(write(tmp_path, text), check_models=True)

    # The target as its own draft shares its tokenizer; the ngram drafter needs no draft at all.
    same = f'[engine]\ntarget = "{shipped_models / "target"}"\ndraft = "{shipped_models / "target"}"\n'
    load_config(write(tmp_path, same), check_models=True)
    lookups = f'[engine]\ntarget = "{shipped_models / "target"}"\ndrafter = "ngram"\ndraft = "{tmp_path}"\n'
    load_config(write(tmp_path, lookups), check_models=True)


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    from tests.conftest import save_tiny, tiny_hf_model

    target = save_tiny(tiny_hf_model("llama", vocab_size=64), tmp_path / "target")
    draft = save_tiny(tiny_hf_model("llama", vocab_size=96), tmp_path / "draft")
    text = f'[engine]\ntarget = "{target}"\ndraft = "{draft}"\n'
    with pytest.raises(ConfigError, match="engine.draft: .* does not share the target's tokenizer"):
        load_config(write(tmp_path, text), check_models=True)


def test_a_target_the_ranks_cannot_share_evenly_is_refused_by_the_check(tmp_path):
    """tensor_parallel must divide the target's heads, KV heads and MLP units (6, 2, 1024 here):
    a config check says so in one line, before any rank is started."""
    target = ROOT / "models" / "target"
    text = f'[engine]\ntarget = "{target}"\ndrafter = "ngram"\ntensor_parallel = 4\n'
    with pytest.raises(ConfigError, match="engine.tensor_parallel: 4 ranks cannot share 6 heads, 2 KV heads"):
        load_config(write(tmp_path, text), check_models=True)
    load_config(write(tmp_path, text.replace("= 4", "= 2")), check_models=True)


def test_a_huge_value_is_echoed_by_a_short_prefix_and_its_size(tmp_path):
    huge = "x" * 10_000_000
    issues = issues_of(tmp_path, f'[adaptive]\nstrategy = "{huge}"\n[engine]\ndevice = "{huge}"\n')
    assert set(issues) == {"adaptive.strategy", "engine.device"}
    for message in issues.values():
        assert len(message) < 600 and "(10000002 characters)" in message
    many = "".join(f"k{i} = 1\n" for i in range(5000))
    issues = issues_of(tmp_path, f"[engine]\n{many}")
    assert len(issues) == 51 and issues["<file>"] == "4950 more problems not listed"
    assert len(issues_of(tmp_path, f"[engine]\n{'y' * 100_000} = 1\n")) == 1  # a huge key: one short issue


def test_old_key_names_still_load_with_a_warning(tmp_path):
    """ "step" meant k in these names; they are renamed, and a file that uses them keeps working."""
    text = (
        "[engine]\nmax_steps = 9\n[adaptive]\ncandidate_steps = [0, 2, 4]\nstatic_steps = 2\ninitial_steps = 4\n"
        "[[adaptive.slots]]\nmin_batch_size = 4\ncandidate_steps = [0, 2]\n"
    )
    snapshot = load_config(write(tmp_path, text))
    assert snapshot.engine.max_k == 9 and snapshot.adaptive.policy.candidate_k == (0, 2, 4)
    assert (snapshot.adaptive.static_k, snapshot.adaptive.initial_k) == (2, 4)
    assert snapshot.adaptive.policy.slots == (BatchSlot(4, (0, 2)),)
    assert len(snapshot.warnings) == 5
    assert "adaptive.candidate_steps is deprecated: it is now called candidate_k" in snapshot.warnings
    assert "is the old name of static_k, which is set too" in issues_of(
        tmp_path, "[adaptive]\nstatic_steps = 2\nstatic_k = 3\n"
    ).get("adaptive.static_steps", "")
    assert load_config(write(tmp_path, "[adaptive]\nstatic_k = 3\n")).warnings == ()
