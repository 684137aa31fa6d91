"""A short soak: clients of every kind while the config is edited and k pinned and forced."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_a_short_soak_loses_nothing_and_every_greedy_reply_is_target_only(tmp_path):
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "bench.soak", "--clients", "8", "--seconds", "10", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert done.returncode == 0, report
    assert report["completed"] > 0 and report["failed"] == {} and report["hung"] == 0
    assert report["mismatched"] == 0 and report["exit_code"] == 0
    assert report["generation"] == 1 + report["valid_edits"]
    assert sum(report["chaos_actions"].values()) >= 5
