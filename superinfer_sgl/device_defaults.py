"""Per-device defaults our launcher adds when the user did not set them.

CUDA: FlashInfer attention. CPU: torch_native attention, no CUDA graphs, sleep when idle, and a KV
budget sized to the machine's RAM (SGLang's own default would try to grab most of it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .launch_checks import flag_value

# Share of available RAM the CPU KV pool may use by default, and a cap that keeps startup fast.
CPU_KV_RAM_FRACTION = 0.10
CPU_KV_MAX_TOKENS = 65536
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "auto": 2}


@dataclass(frozen=True)
class DeviceDefaults:
    cpu: bool
    flags: tuple[tuple[str, str | None], ...]


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def kv_bytes_per_token(model_path: str, dtype: str) -> int:
    with open(os.path.join(os.path.expanduser(model_path), "config.json")) as f:
        cfg = json.load(f)
    layers = cfg["num_hidden_layers"]
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return layers * 2 * heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


def cpu_kv_budget_tokens(model_path: str, dtype: str) -> int:
    import psutil

    try:
        per_token = kv_bytes_per_token(model_path, dtype)
    except (OSError, KeyError, ValueError):
        return 8192  # not a local folder we can read: a small, safe budget
    budget = int(psutil.virtual_memory().available * CPU_KV_RAM_FRACTION) // per_token
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
