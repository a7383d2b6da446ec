"""The tracked tree travels to the GPU machine with every device call, beside a 31 MiB SGLang bundle,
and a call carries at most 64 MiB: the tree stays under 16 MiB, and no single tracked file grows
past 1 MiB (raw logs and datasets stay on the machine that made them; results/README.md)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_TREE_BYTES = 16 * 2**20
MAX_FILE_BYTES = 2**20


def _tracked() -> dict[str, int]:
    assert shutil.which("git") is not None and (ROOT / ".git").exists(), \
        "run from a git checkout: the guard measures what git tracks (CI runs on a clone)"
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [f for f in out.decode().split("\0") if f]
    # A file deleted in the work tree but not yet staged no longer travels.
    return {f: (ROOT / f).stat().st_size for f in files if (ROOT / f).is_file()}


def test_tracked_tree_fits_beside_the_gpu_bundle() -> None:
    sizes = _tracked()
    total = sum(sizes.values())
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= MAX_TREE_BYTES, f"tracked tree {total / 2**20:.1f} MiB > 16 MiB; largest: {biggest}"


def test_no_tracked_file_over_1_mib() -> None:
    big = {f: n for f, n in _tracked().items() if n > MAX_FILE_BYTES}
    assert not big, big
