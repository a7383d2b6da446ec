# Sourced by scripts/gpu_ab.sh and scripts/gpu_server_check.sh on the GPU machine: SGLang 0.5.23 from the
# bundle on the image's torch 2.11, this project installed into the same tree, bytecode compiled once.
# Needs B (the carried bundle folder, e.g. .gpu_bundle) and R (where it unpacks, outside the repo, kept while
# the machine stays warm). Defines gpu_stack_setup (returns non-zero on failure, with the reason on stderr).
export PYTHONUNBUFFERED=1 SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1   # sglang-kernel 0.4.5 < 0.4.9 check
export TVM_FFI_CACHE_DIR=$R/cache/tvm-ffi XDG_CACHE_HOME=$R/cache HF_HUB_OFFLINE=1
# SGLang's Rust radix-tree core is built for torch 2.14: on the image's torch 2.11 its binding reads an
# int64 KV-index tensor as "Float" and the first prefill fails (stock scheduling too): the Python tree core.
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-python}
unset TRITON_INTERPRET PYTHONDONTWRITEBYTECODE
export PYTHONPATH=$R/site${PYTHONPATH:+:$PYTHONPATH}

gpu_stack_setup() {
  mkdir -p "$R"
  [ -d "$R/site" ] || tar -C "$R" -xJf "$B/sgl523_t211_site.tar.xz" || { echo "bundle unpack failed" >&2; return 1; }
  # the model's config and tokenizer: model.tar.xz (holding model/) or a model/ folder, as bringup.sh takes
  if [ ! -d "$R/model" ]; then
    if [ -f "$B/model.tar.xz" ]; then tar -C "$R" -xJf "$B/model.tar.xz" || { echo "model unpack failed" >&2; return 1; }
    elif [ -d "$B/model" ]; then cp -r "$B/model" "$R/model" || { echo "model copy failed" >&2; return 1; }
    else echo "no model in $B: model.tar.xz or model/ (../shared/gpu/README.md)" >&2; return 1; fi
  fi
  # SGLang 0.5.23 builds a DualGemm for every Llama MLP on CUDA and imports its Blackwell-only CuTe DSL
  # kernel module for that, which needs nvidia-cutlass-dsl (not in the image, too large to carry). On Hopper
  # the kernel is never usable (tcgen05), so where cutlass is missing a module that says so stands in.
  local dg=$R/site/sglang/kernels/ops/gemm/cutedsl_dual_gemm.py
  if ! python3 -c "import cutlass" 2>/dev/null && [ -f "$dg" ] && ! grep -q "stands in" "$dg"; then
    cat > "$dg" <<'EOF2'
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
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$R/site" . \
    >"$R/install.txt" 2>&1 || { echo "project install failed:" >&2; tail -20 "$R/install.txt" >&2; return 1; }
  # One bytecode compile of the whole tree (every server, scheduler and client process would otherwise
  # compile SGLang again); files some interpreter cannot parse are skipped, not fatal.
  [ -f "$R/.compiled" ] || { python3 -m compileall -q -j 0 "$R/site" >/dev/null 2>&1; touch "$R/.compiled"; }
  python3 -m compileall -q -j 0 "$R/site/superinfer_sgl" "$R/site/superinfer_patches" >/dev/null 2>&1
  return 0
}

gpu_stack_report() {  # device and versions, and two sgl_kernel ops against torch
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 - <<'EOF3'
import importlib.metadata as md, torch, triton, sgl_kernel
print("torch", torch.__version__, "triton", triton.__version__, "sgl_kernel", sgl_kernel.__version__,
      "sglang", md.version("sglang"), "superinfer-sgl", md.version("superinfer_sgl"), torch.cuda.get_device_name())
x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16); w = torch.ones(576, device="cuda", dtype=torch.bfloat16)
ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
print("sgl_kernel.rmsnorm max err", (sgl_kernel.rmsnorm(x, w, 1e-6) - ref).abs().max().item())
EOF3
}
