#!/usr/bin/env bash
# Set up the venv if needed, then run the whole test suite (unit + end-to-end on the real model).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "${SUPERINFER_VENV:-$ROOT/.venv}/bin/python" -m pytest tests "$@"
