#!/usr/bin/env bash
# Our server inside SGLang on the lent GPU, in one device call (device tool: `bash scripts/gpu_server_check.sh`,
# carrying .gpu_bundle). Needs, built here first (../shared/gpu/README.md):
#   .gpu_bundle/sgl523_t211_site.tar.xz   SGLang 0.5.23 for the GPU image's torch 2.11 (build_bundle.sh)
#   .gpu_bundle/model.tar.xz              model/: SmolLM2-135M's config.json + tokenizer files (weights: dummy);
#                                         the Llama-3-8B-shaped folder is made from it there (bench/profiles.py)
# Stages, each under its own time limit so that a slow one leaves the others' results:
#   1. unpack SGLang, install this project into the same tree, check two sgl_kernel ops against torch
#   2. scripts/gpu_lossless_check.py: forced rotations on a GPU server, KV byte check, greedy tokens
#   3. a short A/B (scripts/ab_bench.py --profile gpu, calibrated) on the Llama-3-8B shape, as far as time allows
# Everything lands in $OUT (one tarball + the JSONs: the device tool returns at most 8 files).
set -u
OUT=${OUT:-results/gpu_server}; mkdir -p "$OUT"
LIMIT=${LIMIT:-560}                  # seconds for the whole script (the device call's limit minus a margin)
t0=$(date +%s); left() { echo $(( LIMIT - ($(date +%s) - t0) )); }
B=$(pwd)/.gpu_bundle; R=${SG_ROOT:-$HOME/sg}; W=$(mktemp -d)
# the stack (bundle, stand-ins, this project, one bytecode compile): shared with scripts/gpu_ab.sh
. scripts/gpu_stack.sh
finish() { tar -czf "$OUT/logs.tgz" -C "$W" . 2>/dev/null; echo "total: $(( $(date +%s) - t0 ))s"; }
trap finish EXIT
# 1. the stack
gpu_stack_setup || exit 1
gpu_stack_report 2>&1 | tee "$OUT/device.txt"
python3 -c "from pathlib import Path; from superinfer_sgl.bench.profiles import make_dummy_model as m
m('llama3-8b', Path('$R/model'), Path('$R'))" || exit 1
echo "stage 1 done at $(( $(date +%s) - t0 ))s"
# 2. lossless rotation on the GPU server
timeout $(( $(left) > 240 ? 240 : $(left) )) python3 scripts/gpu_lossless_check.py --model-path $R/model \
  --out $W/lossless >$W/lossless.txt 2>&1; echo "lossless rc=$?"
cp $W/lossless/lossless.json "$OUT/" 2>/dev/null; tail -25 $W/lossless.txt
echo "stage 2 done at $(( $(date +%s) - t0 ))s"
# 3. a short A/B on the Llama-3-8B shape (two servers, one GPU: each takes a share of its memory)
if [ "$(left)" -gt 200 ]; then
  budget=$(python3 -c "print(round(max(1.0, ($(left) - 170) / 60), 1))")
  timeout $(( $(left) - 15 )) python3 scripts/ab_bench.py --profile gpu --model-path $R/dummy-llama3-8b \
    --calibrate --budget-min $budget --no-point-probes \
    --server-args "--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.4 --cuda-graph-max-bs-decode 128" \
    --out $W/ab >$W/ab.txt 2>&1; echo "ab_bench rc=$? (budget ${budget} min)"
  cp $W/ab/ab.json $W/ab/table.md "$OUT/" 2>/dev/null; tail -30 $W/ab.txt
fi
