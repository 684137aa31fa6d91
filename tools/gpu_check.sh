#!/usr/bin/env bash
# What a lent GPU checks, in one run (about 5 minutes on an H200): every CUDA test, prompts through
# prefill graphs against eager prefill, and sampled code with each feature drafter against
# target-only. Run from the repository root after `pip install -e .[dev]`; results go to $OUT
# (default ./gpu-results).
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
# Beside config.toml: its relative paths resolve against the file's own directory.
CONFIG=.gpu-check.toml
sed 's/^device = "cpu"/device = "cuda"/' config.toml > "$CONFIG"
python -m pytest -q -rs tests/test_backend.py tests/test_prefill_graphs.py tests/test_device_sampling.py \
    2>&1 | tail -40 | tee "$OUT/tests.txt"
python -m bench.prefill --config "$CONFIG" --prompts 24 --repeats 3 2>&1 | tee "$OUT/prefill.txt"
python -m bench.prefill --config "$CONFIG" --drafter none --prompts 24 --repeats 3 2>&1 | tee "$OUT/prefill_target.txt"
for drafter in eagle3 dflash; do
    python -m bench.spec --config "$CONFIG" --drafter "$drafter" \
        --workload bench/workloads/suite/code-sampled.heldout.jsonl \
        --modes none,static:1,static:3,static:5,static:7,adaptive:positional --repeats 1 \
        2>&1 | tail -30 | tee "$OUT/sampled_$drafter.txt"
done
