#!/usr/bin/env bash
# The H200 benchmark run (docs/performance.md), from the repo root on the accelerator machine:
#   OUT=/some/dir [SPLITSERVE_COMMIT=<sha>] bash tools/gpu/run_h200.sh
# (SPLITSERVE_COMMIT names the commit when the tree there is a copy without git history.)
# Each step is guarded (a failure does not stop the next) and time-limited; the benchmark fits
# in ~9 minutes (~3 for the kernels and the bf16 rows, ~2 for each one-byte-KV throughput row),
# and the W8A8 checks after it in at most 17 more (not yet timed on the H200).
# Results land in "$OUT": kernels.json, suite.json (written after every suite step),
# fp8_linear.json and engine_check_w8a8*.json,
# h200_llama-3.1-8b.json (the summary), and one log per step.
# PARTS picks the parts (default "kernels suite engine_checks summary"); "spec_policy", in no
# default, is the speculation policy's table (issue 37: step cost by drafts, the policy's k and
# TPOT at forced acceptance, batch 1-128; spec_policy.json, rewritten after every batch), alone:
#   OUT=/some/dir PARTS=spec_policy bash tools/gpu/run_h200.sh
# (SPEC_POLICY_ARGS: more probe flags, e.g. "--smoke" for a dry run on a CPU.)
set -u
OUT="${OUT:?set OUT to the results folder}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
PY="${PYTHON:-python3}"
PARTS=" ${PARTS:-kernels suite engine_checks summary} "
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
part() { [[ "$PARTS" == *" $1 "* ]]; }  # part NAME: whether PARTS names it

# (a) Triton kernels vs torch references on the GPU.
part kernels && step kernels 90 "$PY" tools/gpu/gpu_kernels_check.py --out "$OUT/kernels.json"
# (b)-(e) one process, model loaded once per engine configuration; partial results survive.
part suite && step suite 620 "$PY" tools/gpu/h200_suite.py --out-dir "$OUT" --steps "$SUITE_STEPS"
# (e2) W8A8 correctness with every headline: the layers (row alone against the batch) and the
# fast path against the torch reference at batch 1 and batched, with and without an fp8 cache
# (W8A8's own noise floor widens the tolerance: gpu_engine_check.py). ENGINE_CHECKS=0 skips them.
if part engine_checks && [ "${ENGINE_CHECKS:-1}" = 1 ]; then
  step fp8_linear 120 "$PY" tools/gpu/fp8_linear_check.py --out "$OUT/fp8_linear.json"
  step engine_check_w8a8 300 "$PY" tools/gpu/gpu_engine_check.py --quantization fp8 \
    --out "$OUT/engine_check_w8a8.json"
  step engine_check_w8a8_fp8kv 300 "$PY" tools/gpu/gpu_engine_check.py --quantization fp8 \
    --kv-cache-dtype fp8 --out "$OUT/engine_check_w8a8_fp8kv.json"
  step engine_check_w8a8_bs1 300 "$PY" tools/gpu/gpu_engine_check.py --quantization fp8 \
    --max-num-seqs 1 --out "$OUT/engine_check_w8a8_bs1.json"
fi
# (f) summary with goals and gaps.
part summary && step summary 30 "$PY" tools/gpu/summarize_h200.py --out-dir "$OUT" --model llama-3.1-8b
# (g) the speculation policy's table: dummy 8B in bf16, its own engine (about 2-4 minutes
# expected; not yet timed whole on the H200: batch 1-64 of an earlier version ran).
read -r -a SPEC_POLICY_EXTRA <<<"${SPEC_POLICY_ARGS:-}"
part spec_policy && step spec_policy 540 "$PY" tools/probes/probe_spec_policy_gpu.py \
  --out "$OUT/spec_policy.json" "${SPEC_POLICY_EXTRA[@]}"
echo "total $(( $(date +%s) - T0 ))s"
