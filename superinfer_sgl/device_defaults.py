"""Per-device defaults our launcher adds when the user did not set them.

CUDA: FlashInfer attention. CPU: torch_native attention, no CUDA graphs, sleep when idle, and a KV
budget sized to the machine's RAM (SGLang's own default would try to grab most of it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .host_memory import available_ram_bytes
from .kv_geometry import model_kv_bytes_per_token
from .launch_checks import LaunchError, flag_value, parallel_size

# Share of available RAM the CPU KV pool may use by default, and a cap that keeps startup fast.
CPU_KV_RAM_FRACTION = 0.10
CPU_KV_MAX_TOKENS = 65536


@dataclass(frozen=True)
class DeviceDefaults:
    cpu: bool
    flags: tuple[tuple[str, str | None], ...]


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def kv_bytes_per_token(model_path: str, dtype: str) -> int:
    return model_kv_bytes_per_token(model_path, dtype)


def cpu_kv_budget_tokens(model_path: str, dtype: str) -> int:
    try:
        per_token = kv_bytes_per_token(model_path, dtype)
    except (OSError, KeyError, ValueError):
        return 8192  # not a local folder we can read: a small, safe budget
    budget = int(available_ram_bytes() * CPU_KV_RAM_FRACTION) // per_token
    return max(1024, min(CPU_KV_MAX_TOKENS, budget))


def device_defaults(argv: list[str]) -> DeviceDefaults:
    device = flag_value(argv, "--device")
    cpu = device == "cpu" or (device is None and not has_cuda())
    if not cpu:
        return DeviceDefaults(False, (("--attention-backend", "flashinfer"),))
    model = flag_value(argv, "--model-path") or flag_value(argv, "--model") or ""
    dtype = flag_value(argv, "--dtype") or "auto"
    return DeviceDefaults(True, (
        ("--device", "cpu"),
        ("--attention-backend", "torch_native"),
        ("--cuda-graph-backend-decode", "disabled"),
        ("--cuda-graph-backend-prefill", "disabled"),
        ("--max-total-tokens", str(cpu_kv_budget_tokens(model, dtype))),
        # SGLang's scheduler otherwise spins a core at 100% while idle; the poller wakes on the
        # next request at once, and our hook keeps it awake while rotary requests wait.
        ("--sleep-on-idle", None),
    ))


THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def cpu_ranks(argv: list[str]) -> int:
    """Scheduler processes SGLang starts: dp x tp x pp (each binds its own cores on CPU)."""
    return parallel_size(argv, "dp") * parallel_size(argv, "tp") * parallel_size(argv, "pp")


def numa_nodes() -> int:
    try:
        return max(1, sum(1 for d in os.listdir("/sys/devices/system/node") if d[4:].isdigit()
                          and d.startswith("node")))
    except OSError:
        return 1


def cpu_threads_bind(ranks: int, cores: list[int]) -> str:
    """SGLang's per-rank core list ("0-3|4-7"): the cores this process may use, split evenly into
    `ranks` contiguous groups (a remainder is left unused, so the ranks stay equal)."""
    cores = sorted(cores)
    per = len(cores) // ranks
    if per < 1:
        raise LaunchError(f"{ranks} CPU ranks (dp x tp x pp) need at least {ranks} cores, this process "
                          f"may use {len(cores)}; use fewer ranks or set {THREADS_BIND_ENV}")
    return "|".join(_cpulist(cores[r * per:(r + 1) * per]) for r in range(ranks))


def _cpulist(cores: list[int]) -> str:
    """Sorted core ids as a Linux cpulist: [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def default_threads_bind(argv: list[str]) -> str | None:
    """The binding our launcher sets on CPU when several ranks would outnumber the NUMA nodes
    (SGLang then refuses to start unless told which cores each rank gets); None: SGLang's own
    choice stands (one rank, more NUMA nodes than ranks, or the user set it)."""
    ranks = cpu_ranks(argv)
    if ranks <= 1 or THREADS_BIND_ENV in os.environ or ranks <= numa_nodes():
        return None
    return cpu_threads_bind(ranks, list(os.sched_getaffinity(0)))


def parse_cpulist(text: str) -> set[int]:
    """A Linux cpulist back to core ids: "0-2,5" -> {0, 1, 2, 5}."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def replica_threads_binds(replicas: int, argv: list[str]) -> list[str] | None:
    """One core group per replica when several single-rank CPU servers share this machine (each
    would otherwise run its threads on every core: 2 replicas on 2 cores thrash); None: the user
    set the binding, a replica runs several ranks, or there are fewer cores than replicas."""
    cores = list(os.sched_getaffinity(0))
    if (replicas <= 1 or THREADS_BIND_ENV in os.environ or cpu_ranks(argv) > 1 or len(cores) < replicas
            or not device_defaults(argv).cpu):
        return None
    return cpu_threads_bind(replicas, cores).split("|")
