#!/usr/bin/env bash
# The whole stack on one H200, measured through the gateway's REST API (`splitserve bench
# online`), from the repo root on the accelerator machine:
#   OUT=/some/dir [SPLITSERVE_COMMIT=<sha>] [WHEELS=dir] bash tools/gpu/run_online_h200.sh
# Two stacks, one after the other, on dummy Llama-3.1-8B weights in bf16:
#   disagg    `splitserve up`: gateway + prefill worker + decode worker (processes), KV handed
#             over shared memory; each worker gets 40% of the GPU's memory;
#   colocated `splitserve serve --role colocated`: one engine (40% of the GPU) with the gateway
#             in the same process.
# Against each: random 1000 in / 256 out at max concurrency 1, 16, 64, 128; Poisson arrivals at
# 8 req/s; a shared-prefix workload (8 prefixes of 2000 tokens). Then the same engine offline
# (no gateway, no gRPC) at 64 sequences, for the serving overhead.
# The dummy model has no tokenizer: tools/synthetic_tokenizer.py writes a byte-level one of the
# model's vocabulary size (the gateway detokenizes with it). WHEELS, if set, is a folder of
# wheels the machine lacks (grpcio >= 1.85.1, fastapi, uvicorn, OpenTelemetry...), installed
# with --no-deps into /tmp/site.
set -u
OUT="${OUT:?set OUT to the results folder}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-deps --target /tmp/site "$WHEELS"/*.whl >"$OUT/pip.log" 2>&1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)" PYTHONUNBUFFERED=1
# The model and the lengths can be changed (e.g. MODEL=dummy:tiny VOCAB=512 MAX_LEN=2048 IN=100
# OUT_LEN=16 PREFIX=200 SUFFIX=20 CONCURRENCY="1 4" for a dry run on a CPU).
MODEL="${MODEL:-dummy:llama-3.1-8b}" VOCAB="${VOCAB:-128256}" MAX_LEN="${MAX_LEN:-4096}"
IN="${IN:-1000}" OUT_LEN="${OUT_LEN:-256}" PREFIX="${PREFIX:-2000}" SUFFIX="${SUFFIX:-200}"
CONCURRENCY="${CONCURRENCY:-1 16 64 128}"
STACKS="${STACKS:-disagg colocated offline}"  # which of the three parts to run
TOK="$("$PY" -m tools.synthetic_tokenizer --vocab-size "$VOCAB" --out-dir /tmp/bench_tok)"
# EXTRA_ARGS: more worker flags, e.g. "--kv-transports shm,stream" (no CUDA IPC).
read -r -a EXTRA <<<"${EXTRA_ARGS:-}"
ENGINE=(--model "$MODEL" --tokenizer "$TOK" --max-model-len "$MAX_LEN"
        --gpu-memory-utilization 0.4 --max-num-seqs 256 "${EXTRA[@]}")
T0=$(date +%s)

wait_ready() {  # wait_ready PID: until the REST port answers /health, or the process died
  for _ in $(seq 600); do
    "$PY" -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:8000/health", timeout=2)' \
      2>/dev/null && return 0
    kill -0 "$1" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

bench_all() {  # bench_all TAG: the online workloads against the stack on :8000
  local tag=$1 c
  for c in $CONCURRENCY; do
    local n=$(( c < 4 ? 8 : 2 * c ))
    timeout 300 "$PY" -m splitserve bench online --num-prompts "$n" --max-concurrency "$c" \
      --input-len "$IN" --output-len "$OUT_LEN" --vocab-size "$VOCAB" --goodput ttft:500 tpot:50 \
      --out "$OUT/online_${tag}_c${c}.json" >"$OUT/online_${tag}_c${c}.log" 2>&1
    echo "  $tag c=$c rc=$? at +$(( $(date +%s) - T0 ))s"
  done
  timeout 300 "$PY" -m splitserve bench online --num-prompts 240 --request-rate 8 \
    --input-len "$IN" --output-len "$OUT_LEN" --vocab-size "$VOCAB" --goodput ttft:500 tpot:50 \
    --out "$OUT/online_${tag}_rate8.json" >"$OUT/online_${tag}_rate8.log" 2>&1
  echo "  $tag rate 8 rc=$? at +$(( $(date +%s) - T0 ))s"
  timeout 300 "$PY" -m splitserve bench online --dataset-name shared-prefix --num-groups 8 \
    --prefix-len "$PREFIX" --suffix-len "$SUFFIX" --output-len 128 --num-prompts 128 \
    --max-concurrency 16 --vocab-size "$VOCAB" --goodput ttft:500 tpot:50 \
    --out "$OUT/online_${tag}_prefix.json" >"$OUT/online_${tag}_prefix.log" 2>&1
  echo "  $tag shared-prefix rc=$? at +$(( $(date +%s) - T0 ))s"
}

stop() {  # stop PID: SIGTERM (orderly stop), then wait
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$1" 2>/dev/null
}

if [[ " $STACKS " == *" disagg "* ]]; then
echo "== disaggregated (gateway + prefill + decode)"
setsid "$PY" -m splitserve up --log-dir "$OUT/logs_disagg" "${ENGINE[@]}" \
  >"$OUT/up_disagg.log" 2>&1 &
UP=$!
if wait_ready "$UP"; then
  echo "  ready at +$(( $(date +%s) - T0 ))s"; bench_all disagg
else
  echo "  did not start"; tail -n 30 "$OUT"/logs_disagg/*.log
fi
stop "$UP"
fi

if [[ " $STACKS " == *" colocated "* ]]; then
echo "== colocated (one engine, gateway in-process)"
setsid "$PY" -m splitserve serve --role colocated --port 8000 "${ENGINE[@]}" \
  >"$OUT/colocated.log" 2>&1 &
CO=$!
if wait_ready "$CO"; then
  echo "  ready at +$(( $(date +%s) - T0 ))s"; bench_all colocated
else
  echo "  did not start"; tail -n 30 "$OUT/colocated.log"
fi
stop "$CO"
fi

if [[ " $STACKS " == *" offline "* ]]; then
echo "== offline, same engine settings, 64 sequences at a time"
timeout 300 "$PY" -m splitserve bench offline --model "$MODEL" --max-model-len "$MAX_LEN" \
  --max-num-seqs 64 --num-prompts 128 --input-len "$IN" --output-len "$OUT_LEN" \
  --gpu-memory-utilization 0.4 --out "$OUT/offline_c64.json" >"$OUT/offline_c64.log" 2>&1
echo "  rc=$? at +$(( $(date +%s) - T0 ))s"
fi
"$PY" - "$OUT" <<'EOF'
import glob, json, os, sys
rows = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(f)); m = d.get("metrics", {})
    if "output_throughput" not in m:
        continue
    g = lambda k: m.get(k, {}).get("median_ms", float("nan"))
    rows.append(f"{os.path.basename(f):32s} done {m.get('completed', '?'):>4} failed "
                f"{m.get('failed', 0):>3}  out tok/s {m['output_throughput']:8.1f}  TTFT "
                f"{g('ttft'):8.1f}  TPOT {g('tpot'):6.2f}  ITL {g('itl'):6.2f} ms")
print("\n".join(rows))
EOF
echo "total $(( $(date +%s) - T0 ))s"
