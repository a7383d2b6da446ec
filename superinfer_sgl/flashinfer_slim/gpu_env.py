"""The environment FlashInfer's JIT needs on the GPU machine: the flashinfer_gpu_env.sh text that travels in
the tar.xz, sourcing it here, CUDA home discovery, and a libcuda stub for machines without the driver."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from superinfer_sgl.flashinfer_slim.common import log

GPU_ENV_SH = r"""# Environment for FlashInfer's JIT on the lent GPU machine. Written by scripts/slim_flashinfer.py into the root
# of flashinfer.tar.xz. Use:  tar -C DIR -xJf flashinfer.tar.xz && . DIR/flashinfer_gpu_env.sh
# Sets PYTHONPATH (DIR first), FLASHINFER_WORKSPACE_BASE (JIT cache under $BASE/.cache/flashinfer/<ver>/<arch>/),
# FLASHINFER_CUDA_ARCH_LIST, MAX_JOBS, CUDA_HOME (followed through an nvcc wrapper or link), and, where the
# toolkit lacks them, FLASHINFER_EXTRA_CUDAFLAGS (-isystem for curand_kernel.h, which CUTLASS's util headers
# pull into the fa3/sm90 kernels) and FLASHINFER_EXTRA_LDFLAGS (-L a folder of libcudart.so / libcuda.so links).
FI_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PYTHONPATH=$FI_ROOT${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$FI_ROOT/ws}
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1; then
  _n=$(readlink -f "$(command -v nvcc)")
  _w=$(grep -ao '/[^ "]*/bin/nvcc' "$_n" 2>/dev/null | head -1)   # a wrapper script: exec /usr/local/cuda-X/bin/nvcc
  [ -n "$_w" ] && [ -x "$_w" ] && _n=$(readlink -f "$_w")
  export CUDA_HOME=$(dirname "$(dirname "$_n")")
fi
_PY=${FI_PYTHON:-python3}
_find() {  # _find NAME: first match in the toolkit, then in the interpreter's nvidia-* wheels
  for d in "$CUDA_HOME/include" "$CUDA_HOME/targets/x86_64-linux/include" "$CUDA_HOME/lib64" "$CUDA_HOME/lib" \
           "$CUDA_HOME/lib64/stubs" "$CUDA_HOME/targets/x86_64-linux/lib"; do
    for f in "$d"/$1; do [ -e "$f" ] && { echo "$f"; return 0; }; done
  done
  "$_PY" - "$1" <<'PYEOF' 2>/dev/null
import glob, os, sys
for p in sys.path:
    for f in sorted(glob.glob(os.path.join(p, "nvidia", "*", "*", sys.argv[1]))):
        print(f); raise SystemExit(0)
PYEOF
}
_FI_FLAGS=""
if [ ! -e "$CUDA_HOME/include/curand_kernel.h" ]; then
  _h=$(_find curand_kernel.h | head -1)
  [ -n "$_h" ] && _FI_FLAGS="-isystem $(dirname "$_h")"
fi
[ -n "$_FI_FLAGS" ] && export FLASHINFER_EXTRA_CUDAFLAGS="${FLASHINFER_EXTRA_CUDAFLAGS:+$FLASHINFER_EXTRA_CUDAFLAGS }$_FI_FLAGS"
_L=$FI_ROOT/libs; mkdir -p "$_L"
if [ ! -e "$CUDA_HOME/lib64/libcudart.so" ]; then
  _c=$(_find 'libcudart.so' | head -1); [ -z "$_c" ] && _c=$(_find 'libcudart.so.[0-9]*' | head -1)
  [ -n "$_c" ] && ln -sf "$_c" "$_L/libcudart.so"
fi
if [ ! -e "$CUDA_HOME/lib64/stubs/libcuda.so" ]; then
  _d=$( { ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? /{print $NF}'; ls /usr/local/nvidia/lib64/libcuda.so* \
          /usr/lib/x86_64-linux-gnu/libcuda.so* /usr/lib64/libcuda.so* 2>/dev/null; } | head -1)
  [ -n "$_d" ] && ln -sf "$_d" "$_L/libcuda.so"
fi
ls "$_L"/*.so >/dev/null 2>&1 && export FLASHINFER_EXTRA_LDFLAGS="${FLASHINFER_EXTRA_LDFLAGS:+$FLASHINFER_EXTRA_LDFLAGS }-L$_L"
echo "flashinfer env: FI_ROOT=$FI_ROOT CUDA_HOME=${CUDA_HOME:-?} cudaflags='${FLASHINFER_EXTRA_CUDAFLAGS:-}' ldflags='${FLASHINFER_EXTRA_LDFLAGS:-}' libs=[$(cd "$_L" && ls)]" >&2
unset _n _w _h _c _d _L _PY _FI_FLAGS
"""


def add_libcuda_stub(env: dict, cuda_home: str, work: Path) -> None:
    """A machine without the NVIDIA driver has no libcuda.so for FlashInfer's `-lcuda`: link against an empty
    stub with the driver's soname (the modules resolve cu* symbols when loaded on the GPU machine)."""
    libs = [tok[2:] for tok in env.get("FLASHINFER_EXTRA_LDFLAGS", "").split() if tok.startswith("-L")]
    if any((Path(d) / "libcuda.so").exists() for d in libs + [f"{cuda_home}/lib64/stubs", f"{cuda_home}/lib64"]):
        return
    stub = work / "libcuda_stub"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "stub.c").write_text("void flashinfer_slim_libcuda_stub(void) {}\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub / "libcuda.so"),
                    str(stub / "stub.c")], check=True)
    env["FLASHINFER_EXTRA_LDFLAGS"] = (env.get("FLASHINFER_EXTRA_LDFLAGS", "") + f" -L{stub}").strip()
    log(f"[env] no libcuda.so on this machine: linking against an empty stub ({stub})")


def env_from_script(script: Path, python: str, base_env: dict) -> dict:
    """Source flashinfer_gpu_env.sh in bash and return the variables it set."""
    env = dict(os.environ, **base_env, FI_PYTHON=python)
    r = subprocess.run(["bash", "-c", f'. "{script}" && env -0'], env=env, capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{script} failed: {r.stderr}")
    log("[env] " + r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "[env] (no output)")
    keys = ("CUDA_HOME", "MAX_JOBS", "PYTHONPATH")
    out = {}
    for item in r.stdout.split("\0"):
        k, _, v = item.partition("=")
        if k in keys or k.startswith("FLASHINFER_"):
            out[k] = v
    return out


def find_cuda_home() -> str | None:
    for c in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if c and os.path.exists(os.path.join(c, "bin", "nvcc")):
            return c
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        try:  # a wrapper script (`exec /usr/local/cuda-13.0/bin/nvcc`): follow it
            txt = open(real, "rb").read(4096).decode("utf-8", "ignore")
            for tok in txt.split():
                if tok.endswith("/bin/nvcc") and os.path.exists(tok):
                    real = tok
                    break
        except OSError:
            pass
        home = os.path.dirname(os.path.dirname(real))
        if os.path.isdir(os.path.join(home, "include")):
            return home
    for c in sorted(Path("/usr/local").glob("cuda*"), reverse=True):
        if (c / "bin" / "nvcc").exists():
            return str(c)
    return None

