"""How much host RAM new allocations may take now: the machine's free memory, capped by the
container's memory limit (cgroup v2 or v1) where one is set. Inside a Kubernetes pod psutil reports
the whole node's memory: a default sized from it (25% of a 2 TiB node for the rotary pool) would
exceed the pod's limit and get it killed. Stdlib and psutil only: the launcher imports it."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 reports "no limit" as a page-rounded huge number (2**63 - 4096 on x86-64)
_V1_UNLIMITED = 1 << 60


def machine_available_bytes() -> int:
    """RAM available to new allocations on the machine (psutil's `available`)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # psutil ships with SGLang; the bare GPU benchmark image may lack it
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cgroup_room_bytes(root: Path = CGROUP_ROOT) -> int | None:
    """What this process's memory cgroup may still take (limit minus usage, the page cache
    included: the kernel reclaims it before killing, so this errs low); None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),  # v2 (the unified hierarchy)
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # v1
        try:
            limit_text = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None
        try:
            limit = int(limit_text)
        except ValueError:
            continue
        if limit >= _V1_UNLIMITED:
            return None
        return max(0, limit - usage)
    return None


def available_ram_bytes(root: Path = CGROUP_ROOT) -> int:
    """RAM new allocations may take now: the machine's available memory, within the container's limit."""
    room = cgroup_room_bytes(root)
    free = machine_available_bytes()
    return free if room is None else min(free, room)
