"""The shipped systemd unit: notify protocol, reload through adaspecctl, hardening that keeps
accelerators usable. `.ci/run` also runs `systemd-analyze verify` on it where systemd exists."""

from __future__ import annotations

import configparser
import shutil
import subprocess

import pytest

from tests.conftest import ROOT

UNIT = ROOT / "systemd" / "adaspecd.service"


def service() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(UNIT)
    return parser["Service"]


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


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    venv_bin = ROOT / ".venv" / "bin"
    if not (venv_bin / "adaspecd").exists():
        pytest.skip("no .venv with adaspecd installed to point the unit at")
    text = UNIT.read_text().replace("/opt/adaspec/.venv/bin/", f"{venv_bin}/")
    text = text.replace("WorkingDirectory=/opt/adaspec", f"WorkingDirectory={ROOT}")
    unit = tmp_path / "adaspecd.service"
    unit.write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
