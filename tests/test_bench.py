"""The benchmark harness runs any workload file and reports in the documented shape."""

from __future__ import annotations

import json

from bench.spec import main as spec_main
from tests.conftest import perturbed_copy, save_tiny, tiny_hf_model


def test_spec_harness_reports_every_mode_and_phase(tmp_path, capsys):
    target = save_tiny(tiny_hf_model("llama", vocab_size=64), tmp_path / "target")
    draft = perturbed_copy(target, tmp_path / "draft", scale=0.2)
    workload = tmp_path / "work.jsonl"
    lines = [
        {"prompt": "w3 w4 w5 w3 w4", "max_tokens": 24, "phase": "high"},
        {"prompt": "w9 w8", "max_tokens": 24, "temperature": 1.0, "seed": 3, "phase": "low"},
        {"prompt": "w3 w4 w5", "max_tokens": 16, "phase": "high", "stop": ["w7"]},
    ]
    workload.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out, plot = tmp_path / "out.json", tmp_path / "plot.png"
    modes = "none,static:1,static:3,adaptive:ema,adaptive:goodput"
    spec_main(
        ["--workload", str(workload), "--modes", modes, "--concurrency", "2", "--target", str(target)]
        + ["--draft", str(draft), "--json", str(out), "--plot", str(plot), "--max-seq-len", "64"]
    )
    report = json.loads(out.read_text())["modes"]
    assert list(report) == modes.split(",")
    for mode in report.values():
        assert {"tokens_per_s", "tokens", "seconds", "mean_accepted_drafts", "switches", "phases"} <= set(mode)
        assert set(mode["phases"]) == {"high", "low"}
        assert sum(p["tokens"] for p in mode["phases"].values()) == mode["tokens"]
        assert abs(sum(p["seconds"] for p in mode["phases"].values()) - mode["seconds"]) < mode["seconds"] * 0.5
    assert report["none"]["mean_accepted_drafts"] == 0
    assert report["static:3"]["mean_accepted_drafts"] > 0
    # Greedy requests produce the same tokens in every mode: speculation changes speed only.
    assert report["static:1"]["phases"]["high"]["tokens"] == report["none"]["phases"]["high"]["tokens"]
    assert plot.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "per-phase oracle" in printed and "x best static" in printed
