"""Paths, defaults and logging shared by the flashinfer_slim modules."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / ".gpu_bundle" / "flashinfer.tar.xz"
DEFAULT_MAX_MIB = 20.0  # 64 MiB per call - ~8 MiB tracked tree - ~31 MiB SGLang bundle - slack


def log(*a):
    print(*a, file=sys.stderr, flush=True)
