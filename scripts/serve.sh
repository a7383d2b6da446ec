#!/usr/bin/env bash
# Set up the venv if needed, then start the server (default: the embedded SmolLM2 model).
# Extra arguments pass through to `python -m superinfer_sgl.launch_server`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
exec "${SUPERINFER_VENV:-$ROOT/.venv}/bin/python" -m superinfer_sgl.launch_server "$@"
