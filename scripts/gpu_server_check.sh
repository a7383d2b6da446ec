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
B=$(pwd)/.gpu_bundle; R=${SG_ROOT:-$HOME/sg}; W=$(mktemp -d); mkdir -p "$R"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export TVM_FFI_CACHE_DIR=$R/cache/tvm-ffi XDG_CACHE_HOME=$R/cache HF_HUB_OFFLINE=1
# SGLang's Rust radix-tree core is built for torch 2.14: on the image's torch 2.11 its binding reads an
# int64 KV-index tensor as "Float" and the first prefill fails (seen 2026-11-26, stock scheduling too).
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-python}
unset TRITON_INTERPRET
finish() { tar -czf "$OUT/logs.tgz" -C "$W" . 2>/dev/null; echo "total: $(( $(date +%s) - t0 ))s"; }
trap finish EXIT
# 1. the stack
[ -d $R/site ] || tar -C $R -xJf $B/sgl523_t211_site.tar.xz || exit 1
[ -d $R/model ] || tar -C $R -xJf $B/model.tar.xz || exit 1
# SGLang 0.5.23 builds a DualGemm for every Llama MLP on CUDA and imports its Blackwell-only CuTe DSL
# kernel module for that, which needs nvidia-cutlass-dsl (not in the image, too large to carry). On Hopper
# the kernel is never usable (tcgen05), so where cutlass is missing a module that says so stands in.
DG=$R/site/sglang/kernels/ops/gemm/cutedsl_dual_gemm.py
if ! python3 -c "import cutlass" 2>/dev/null && ! grep -q "stands in" $DG; then cat > $DG <<'EOF2'
"""Stands in for SGLang's Blackwell dual GEMM (needs nvidia-cutlass-dsl): never usable here."""
from enum import IntEnum
MAX_DUAL_GEMM_DECODE_TOKENS = 16
class DualGemmQuantMode(IntEnum):
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4
    @property
    def is_quantized(self) -> bool:
        return self != DualGemmQuantMode.UNQUANT
def can_use_dual_gemm(num_tokens, hidden_size, intermediate_size, quant_mode) -> bool:
    return False
EOF2
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $R/site . >$W/install.txt 2>&1 \
  || { echo "project install failed"; tail -20 $W/install.txt; exit 1; }
export PYTHONPATH=$R/site${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 - <<'EOF'
import importlib.metadata as md, torch, triton, sgl_kernel
print("torch", torch.__version__, "triton", triton.__version__, "sgl_kernel", sgl_kernel.__version__,
      "sglang", md.version("sglang"), "superinfer-sgl", md.version("superinfer_sgl"))
x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16); w = torch.ones(576, device="cuda", dtype=torch.bfloat16)
ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
print("sgl_kernel.rmsnorm max err", (sgl_kernel.rmsnorm(x, w, 1e-6) - ref).abs().max().item())
EOF
} 2>&1 | tee "$OUT/device.txt"
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
