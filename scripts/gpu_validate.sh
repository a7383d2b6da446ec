#!/usr/bin/env bash
# Everything the GPU machine runs for us, in one call (device tool: `bash scripts/gpu_validate.sh`):
# the CUDA-marked kernel/engine tests, the KV transfer benchmark and the step-time profile.
# Results go to $OUT (default results/gpu); a short table is printed last. About 5 minutes on an H100
# (the transfer benchmark ~220 s); the JSON is rewritten after each section, so a cut-off run keeps data.
# Each step's timeout is capped by what is left of LIMIT (default 540 s, under the device's 600 s a command).
set -u
LIMIT=${LIMIT:-540}; t0=$(date +%s)
cap() { local left=$(( LIMIT - ($(date +%s) - t0) - 10 )); [ "$1" -lt "$left" ] && echo "$1" || echo $(( left > 1 ? left : 1 )); }
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET
{ nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  >"$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
# 1. tests that exercise CUDA (whole files: their CPU cases run too), no SGLang needed
timeout "$(cap 240)" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/unit/test_kv_kernels.py tests/unit/test_duplex.py tests/unit/test_host_pool.py \
  tests/unit/test_eager_sync.py tests/unit/test_engine.py >"$OUT/pytest_cuda.txt" 2>&1
echo "pytest rc=$?"; tail -5 "$OUT/pytest_cuda.txt"
# 2. KV transfer benchmark (JSON + PNG)
timeout "$(cap 400)" python3 scripts/bench_kv_transfer.py --out "$OUT/kv_transfer_h100.json" >"$OUT/kv_transfer.txt" 2>&1
echo "bench_kv_transfer rc=$?"
# 3. Qwen2.5-32B-shaped step profile
timeout "$(cap 100)" python3 scripts/gpu_step_profile.py --out "$OUT/step_h100.json" >"$OUT/step.txt" 2>&1
echo "gpu_step_profile rc=$?"
tail -n 45 "$OUT/kv_transfer.txt"; cat "$OUT/step.txt"
