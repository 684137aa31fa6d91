"""The shipped systemd unit: notify protocol, reload through adaspecctl, hardening that keeps
accelerators usable. `.ci/run` also runs `systemd-analyze verify` on it where systemd exists."""

from __future__ import annotations

import configparser
import shutil
import subprocess

import pytest

from tests.conftest import ROOT

UNIT = ROOT / "systemd" / "adaspecd.service"
TEMPLATE = ROOT / "systemd" / "adaspecd@.service"  # one replica per instance


def service(unit=UNIT) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(unit)
    return parser["Service"]


def settings(unit) -> list[str]:
    """The unit's setting lines, comments left out."""
    return [line for line in unit.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_unit_uses_notify_with_a_reload_that_can_fail():
    unit = service()
    assert unit["Type"] == "notify"  # notify-reload needs systemd >= 253; Debian 12 has 252
    assert "adaspecctl" in unit["ExecReload"] and unit["ExecReload"].endswith(" reload")
    assert "adaspecd --config" in unit["ExecStart"]
    assert int(unit["WatchdogSec"]) > 0
    assert unit["RuntimeDirectory"] == "adaspec"


def test_hardening_leaves_accelerators_and_jit_working():
    unit = service()
    # The compiled kernels' cache is writable under ProtectSystem=strict (else the slow path serves).
    assert unit["CacheDirectory"] == "adaspec" and unit["Environment"] == "ADASPEC_CACHE_DIR=%C/adaspec"
    assert unit["ProtectSystem"] == "strict" and int(unit["LimitNOFILE"]) >= 65536
    for breaks_ml in ("MemoryDenyWriteExecute", "PrivateDevices", "ProcSubset"):
        assert breaks_ml not in unit
    assert unit["NoNewPrivileges"] == "yes"


def test_the_replica_template_is_the_unit_but_for_its_instance():
    """adaspecd@NAME reads /etc/adaspec/NAME.toml and keeps its admin socket in a runtime folder of
    its own (where `adaspecctl --socket` finds each replica); every other setting is the single
    daemon's, so that a change to one unit cannot leave the other behind."""
    replica = service(TEMPLATE)
    assert replica["ExecStart"].endswith("adaspecd --config /etc/adaspec/%i.toml")
    assert replica["RuntimeDirectory"] == "adaspec/%i"
    assert replica["ExecReload"] == service()["ExecReload"]  # ${RUNTIME_DIRECTORY}: the replica's own
    differ = {"Description", "ExecStart", "RuntimeDirectory"}
    ours = [line for line in settings(UNIT) if line.split("=")[0] not in differ]
    assert [line for line in settings(TEMPLATE) if line.split("=")[0] not in differ] == ours


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("source, name", [(UNIT, "adaspecd.service"), (TEMPLATE, "adaspecd@a.service")])
def test_systemd_analyze_verify_accepts_the_unit(tmp_path, source, name):
    venv_bin = ROOT / ".venv" / "bin"
    if not (venv_bin / "adaspecd").exists():
        pytest.skip("no .venv with adaspecd installed to point the unit at")
    text = source.read_text().replace("/opt/adaspec/.venv/bin/", f"{venv_bin}/")
    text = text.replace("WorkingDirectory=/opt/adaspec", f"WorkingDirectory={ROOT}")
    unit = tmp_path / name
    unit.write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
