#!/usr/bin/env bash
# Stock SGLang vs our server (--policy goodput), one after the other on the lent GPU, in one self-timed
# device call; then, with the time left, the engine's own KV copy paths.
#   GPU:  bash scripts/gpu_ab.sh              (device tool, carrying .gpu_bundle: ../shared/gpu/README.md)
#   CPU:  bash scripts/gpu_ab.sh --cpu-smoke  (the same stages here: smoke profile, the embedded model)
# Env: LIMIT (seconds for the whole script, default 480), OUT (default: a new temp folder), SG_ROOT (GPU:
# where the bundle unpacks, default ~/sg; skipped when already there), AB_EXTRA (more ab_bench.py flags,
# split at spaces: one-word values only).
# Stages, each under its own time limit; a timeline of their times goes to $OUT/timeline.json:
#   setup     unpack the bundle, stand-ins, install this project into it, one bytecode compile (GPU);
#             device and versions -> device.txt
#   ab        scripts/ab_bench.py: a Llama-3-8B-shaped dummy-weight model, KV budget 16k tokens, ~150 requests
#             per point, chunked prefill 1024 (a chunk's step stays well inside the 100 ms TBT SLO), SLO
#             classes standard (5 s / 100 ms) and tight (1 s / 50 ms) kept as given under --calibrate, which
#             sets two rates: at the estimated knee and 1.5x past it; decode CUDA graphs on, capture capped
#             at batch 64 (prefill graphs off: SGLang 0.5.23 captures 38 prefill sizes by default, minutes
#             of a start no run here has tried); every server must get the same KV pool (the harness checks)
#   ab-nograph  only if the first server did not start (not up within 200 s, or exited): the same A/B
#             with CUDA graphs off
#   transfer  python -m superinfer_sgl.bench.kv_transfer --quick: one rotation out, in and both at once
#             through RotationEngine for every path (triton-dma: the pipelined staging ring; its serial
#             form; triton-hybrid; triton-direct) and the path `auto` picks by its probe, then one block
#             size of every path beside the pinned-copy ceiling (the ring's share of it: summary.txt)
# Files back (at most 8): timeline.json, device.txt, ab.json, table.md, kv_transfer.json, summary.txt, logs.tgz
set -u
MODE=gpu
[ "${1:-}" = "--cpu-smoke" ] && MODE=cpu-smoke
LIMIT=${LIMIT:-480}
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd); cd "$REPO"
t0=$(date +%s)
now() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( LIMIT - $(now) )); }
W=$(mktemp -d)   # everything else: logs (tarred into logs.tgz), the A/B's datasets and raw output
TSV=$W/timeline.tsv; : >"$TSV"
PY=python3; [ "$MODE" = cpu-smoke ] && [ -x "$REPO/.venv/bin/python" ] && PY=$REPO/.venv/bin/python

# run_limited LIMIT CMD...: CMD (a shell function too) in a process group of its own; SIGTERM to the group at
# LIMIT seconds (ab_bench.py stops its servers on it), SIGKILL KILL_GRACE s later; returns 124 when the limit cut it
KILL_GRACE=25
run_limited() {
  local limit=$1; shift
  local begin; begin=$(date +%s)
  set -m; ( "$@" ) & local pid=$!; set +m
  # by the clock, not by turns of the loop (a loaded machine's sleeps run long); SIGKILL after a grace
  # longer than a server's own stop grace (bench/servers.py: 20 s)
  ( termed=0
    while kill -0 "$pid" 2>/dev/null; do
      el=$(( $(date +%s) - begin ))
      if [ "$termed" -eq 0 ] && [ "$el" -ge "$limit" ]; then kill -TERM -- "-$pid" 2>/dev/null; termed=1; fi
      [ "$el" -ge $(( limit + KILL_GRACE )) ] && { kill -KILL -- "-$pid" 2>/dev/null; exit 0; }
      sleep 1
    done ) &
  local dog=$!
  wait "$pid"; local rc=$?
  wait "$dog" 2>/dev/null
  [ "$rc" -ne 0 ] && [ $(( $(date +%s) - begin )) -ge "$limit" ] && rc=124
  return $rc
}

# stage NAME LIMIT NOTE CMD...: run CMD under min(LIMIT, time left - 5 s), append its line to the timeline
stage() {
  local name=$1 limit=$2 note=$3; shift 3
  local cap=$(( $(left) - 5 )); [ "$cap" -lt "$limit" ] && limit=$cap
  local start; start=$(now)
  if [ "$limit" -lt 5 ]; then
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$start" "$start" 124 "$limit" "skipped: no time left" >>"$TSV"
    echo "[$name] skipped: no time left"; return 124
  fi
  echo "[$name] start at ${start}s, limit ${limit}s"
  run_limited "$limit" "$@"; local rc=$?
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$start" "$(now)" "$rc" "$limit" "$note" >>"$TSV"
  echo "[$name] rc=$rc after $(( $(now) - start ))s"
  return $rc
}

finish() {
  trap - EXIT
  $PY -m superinfer_sgl.bench.gpu_ab timeline "$TSV" "$OUT/timeline.json" "$LIMIT" "$MODE" | tee -a "$OUT/summary.txt"
  cp "$W/ab/ab.json" "$W/ab/table.md" "$OUT/" 2>/dev/null
  { echo; cat "$OUT/table.md" 2>/dev/null; tail -40 "$W/ab.txt" 2>/dev/null; tail -50 "$W/transfer.txt" 2>/dev/null; } \
    >>"$OUT/summary.txt"
  # server/client logs and step logs (the simulator's replay reads them); not raw output nor datasets
  tar -czf "$OUT/logs.tgz" -C "$W" --exclude='*/raw' --exclude='*.jsonl.tmp' --exclude='ab/dataset*' \
    --exclude='ab/schedules' --exclude='ab/model' . 2>/dev/null
  echo "total: $(now)s of ${LIMIT}s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
}
trap finish EXIT
trap "exit 143" TERM INT HUP   # a cut-off call still writes its timeline and files

# ---- setup
if [ "$MODE" = gpu ]; then
  B=$REPO/.gpu_bundle; R=${SG_ROOT:-$HOME/sg}
  . "$REPO/scripts/gpu_stack.sh"
  setup() {
    gpu_stack_setup || return 1
    gpu_stack_report >"$OUT/device.txt" 2>&1; cat "$OUT/device.txt"
    $PY -c "from pathlib import Path; from superinfer_sgl.bench.profiles import make_dummy_model as m
m('llama3-8b', Path('$R/model'), Path('$R'))"
  }
  stage setup 150 "bundle, stand-ins, install, bytecode compile" setup || exit 1
  MODEL=(--model-path "$R/dummy-llama3-8b")
  # one server at a time holds the GPU: the KV cap (16k tokens) binds well below 0.85 of an H100's memory
  GRAPHS="--cuda-graph-max-bs-decode 64 --cuda-graph-backend-prefill disabled"
  SERVER="--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.85"
  PROFILE=(--profile gpu --kv-tokens 16384 --chunked-prefill 1024 --num-requests 150)
  CLASSES='{"standard": {"ttft_ms": 5000, "tbt_ms": 100}, "tight": {"ttft_ms": 1000, "tbt_ms": 50}}'
  SLOS=(--ttft-slo-ms 5000 --tbt-slo-ms 100 --slo-classes "$CLASSES" --class-mix standard:3,tight:1)
  READY=200; TRANSFER=(--quick --gib 0.25); TRANSFER_S=80
else
  setup() {
    { echo "cpu-smoke: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ($(nproc) cores)"
      $PY -c "import importlib.metadata as md, torch; print('torch', torch.__version__, 'sglang', md.version('sglang'),
'superinfer-sgl', md.version('superinfer_sgl'))"; } >"$OUT/device.txt" 2>&1 || return 1
    $PY -m compileall -q superinfer_sgl patches >/dev/null   # the GPU run compiles its whole tree once
  }
  stage setup 60 "versions, bytecode compile of the package" setup || exit 1
  MODEL=()   # the embedded SmolLM2
  GRAPHS=""; SERVER=""
  PROFILE=(--profile smoke --num-requests 3)
  CLASSES='{"standard": {"ttft_ms": 4000, "tbt_ms": 500}, "tight": {"ttft_ms": 2000, "tbt_ms": 250}}'
  SLOS=(--ttft-slo-ms 4000 --tbt-slo-ms 500 --slo-classes "$CLASSES" --class-mix standard:1,tight:1)
  READY=200; TRANSFER=(--cpu-smoke --quick); TRANSFER_S=30
fi

# ---- the A/B: stock, then ours (goodput), in turn
ab() {  # ab EXTRA_SERVER_FLAGS
  local budget; budget=$($PY -c "print(round(max(0.5, ($(left) - $TRANSFER_S - 20) / 60), 2))")
  $PY scripts/ab_bench.py "${PROFILE[@]}" "${MODEL[@]}" --systems sglang,superinfer \
    --order sequential --workload mixed "${SLOS[@]}" --calibrate --rate-multipliers 1.0,1.5 --budget-min "$budget" \
    --no-point-probes --ready-timeout "$READY" --server-args "$SERVER $1" ${AB_EXTRA:-} --out "$W/ab" \
    >>"$W/ab.txt" 2>&1
}
stage ab $(( $(left) - TRANSFER_S - 12 )) "CUDA graphs ${GRAPHS:-n/a}" ab "$GRAPHS"; rc=$?
if [ -n "$GRAPHS" ] && $PY -m superinfer_sgl.bench.gpu_ab needs-fallback "$W/ab/ab.json"; then
  echo "first server did not start with CUDA graphs: the A/B again with graphs off" | tee -a "$W/ab.txt"
  mv "$W/ab" "$W/ab-graphs"
  stage ab-nograph $(( $(left) - TRANSFER_S - 12 )) "CUDA graphs off (fallback)" ab \
    "--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled"
fi

# ---- the engine's own copy paths, with the time left
stage transfer $(( $(left) - 10 )) "kv_transfer ${TRANSFER[*]}" $PY -m superinfer_sgl.bench.kv_transfer \
  "${TRANSFER[@]}" --time-limit $(( $(left) / 2 )) --out "$OUT/kv_transfer.json" --plot "$W/kv_transfer.png" \
  >"$W/transfer.txt" 2>&1
exit 0
