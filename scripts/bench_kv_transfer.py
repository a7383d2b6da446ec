#!/usr/bin/env python3
"""KV transfer benchmark of DuplexKV's own copy paths: `python -m superinfer_sgl.bench.kv_transfer`.

Kept as a script for the GPU runs and docs that call it by this path; runs from a checkout without
installing (the repository and triton_kernels/ go on sys.path). Options: --help.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "triton_kernels")]

from superinfer_sgl.bench.kv_transfer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
