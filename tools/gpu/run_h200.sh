#!/usr/bin/env bash
# The H200 benchmark run (docs/performance.md), from the repo root on the accelerator machine:
#   OUT=/some/dir [SPLITSERVE_COMMIT=<sha>] bash tools/gpu/run_h200.sh
# (SPLITSERVE_COMMIT names the commit when the tree there is a copy without git history.)
# Each step is guarded (a failure does not stop the next) and time-limited; the whole run fits
# in ~9 minutes (~3 for the kernels and the bf16 rows, ~2 for each one-byte-KV throughput row).
# Results land in "$OUT": kernels.json, suite.json (written after every suite step),
# h200_llama-3.1-8b.json (the summary), and one log per step.
set -u
OUT="${OUT:?set OUT to the results folder}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
PY="${PYTHON:-python3}"
SUITE_STEPS="${SUITE_STEPS:-latency_eager,latency_graphs,ttft_4096,throughput_random,concurrent_128,hf_baseline_128,throughput_random_fp8,throughput_random_int8,throughput_random_w8a8_fp8}"
T0=$(date +%s)

step() {  # step NAME SECONDS CMD...: run with a time limit, log, never abort the script
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  echo "=== $name (limit ${limit}s, at +$((t - T0))s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: rc=$rc in $(( $(date +%s) - t ))s"
}

# (a) Triton kernels vs torch references on the GPU.
step kernels 90 "$PY" tools/gpu/gpu_kernels_check.py --out "$OUT/kernels.json"
# (b)-(e) one process, model loaded once per engine configuration; partial results survive.
step suite 620 "$PY" tools/gpu/h200_suite.py --out-dir "$OUT" --steps "$SUITE_STEPS"
# (f) summary with goals and gaps.
step summary 30 "$PY" tools/gpu/summarize_h200.py --out-dir "$OUT" --model llama-3.1-8b
echo "total $(( $(date +%s) - T0 ))s"
