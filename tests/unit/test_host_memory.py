"""Host RAM defaults inside a container: the pod's memory limit bounds them (a review of the
deployment path, 2026-12-03: psutil reports the whole node inside a pod, so the rotation pool's
default quarter of "free RAM" on a 2 TiB node would have outgrown a 96 GiB pod's limit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from superinfer_sgl import host_memory

GIB = 1 << 30


def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


@pytest.mark.parametrize(("files", "room"), [
    ({"memory.max": str(96 * GIB), "memory.current": str(10 * GIB)}, 86 * GIB),  # v2
    ({"memory.max": "max", "memory.current": str(GIB)}, None),
    ({"memory/memory.limit_in_bytes": str(8 * GIB), "memory/memory.usage_in_bytes": str(9 * GIB)}, 0),  # v1, over
    ({"memory/memory.limit_in_bytes": str((1 << 63) - 4096), "memory/memory.usage_in_bytes": "5"}, None),
    ({}, None),  # no cgroup files: a bare machine
    ({"memory.max": "garbage", "memory.current": "1"}, None),
])
def test_cgroup_room(tmp_path: Path, files: dict[str, str], room: int | None) -> None:
    assert host_memory.cgroup_room_bytes(_cgroup(tmp_path, files)) == room


def test_the_limit_bounds_the_machine_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "machine_available_bytes", lambda: 2048 * GIB)  # the node
    root = _cgroup(tmp_path, {"memory.max": str(96 * GIB), "memory.current": str(6 * GIB)})
    assert host_memory.available_ram_bytes(root) == 90 * GIB
    monkeypatch.setattr(host_memory, "machine_available_bytes", lambda: 40 * GIB)  # the node is the tighter
    assert host_memory.available_ram_bytes(root) == 40 * GIB


def test_the_rotation_pool_default_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default host pool (a share of the free RAM) is sized from the bounded figure."""
    import torch

    from superinfer_sgl.duplexkv.host_pool import HostKVPool, block_bytes

    per_block = block_bytes(2, 2, 8, 16, torch.float32, "auto")
    monkeypatch.setattr(host_memory, "available_ram_bytes", lambda: 40 * per_block)
    assert HostKVPool.default_num_blocks(2, 2, 8, 16, torch.float32, free_ram_fraction=0.25) == 10
