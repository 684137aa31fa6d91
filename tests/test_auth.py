"""Where the API key comes from, and that it stays hidden."""

from __future__ import annotations

from dataclasses import replace

import pytest

from control.issues import ConfigError
from control.load import load_config
from control.snapshot import effective
from daemon.auth import ENV_VAR, api_key
from tests.test_config import write


def test_the_key_comes_from_the_config_a_file_or_the_environment(tmp_path):
    server = load_config(write(tmp_path, "[server]\nport = 0\n")).server
    assert api_key(server, {}) is None  # open
    assert api_key(server, {ENV_VAR: "from-env"}) == "from-env"
    (tmp_path / "key").write_text("  from-file\n")
    from_file = load_config(write(tmp_path, '[server]\napi_key_file = "key"\n')).server  # relative to the config
    assert api_key(from_file, {ENV_VAR: "from-env"}) == "from-file"
    inline = replace(server, api_key="inline")
    assert api_key(inline, {ENV_VAR: "from-env"}) == "inline"


def test_a_key_file_that_cannot_serve_is_a_config_error(tmp_path):
    (tmp_path / "empty").write_text("\n")
    for text, message in [
        ('[server]\napi_key_file = "missing"\n', "cannot read"),
        ('[server]\napi_key_file = "empty"\n', "the key file is empty"),
        ('[server]\napi_key = "a"\napi_key_file = "empty"\n', "not both"),
        ('[server]\napi_key = ""\n', "must not be empty"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(write(tmp_path, text))


def test_the_effective_config_hides_the_key(tmp_path):
    snapshot = load_config(write(tmp_path, '[server]\napi_key = "sk-secret"\n'))
    shown = effective(snapshot)
    assert shown["server.api_key"]["value"] == "<hidden>" and shown["server.api_key"]["source"] == "file"
    assert "sk-secret" not in repr(shown)
