"""Every system of an A/B must get the same KV pool.

SGLang sizes its token pool from the device memory free when the server starts and quietly lowers
`--max-total-tokens` when that memory is short. With servers started in turn on one GPU, a later
server can get a smaller pool than an earlier one (memory not yet returned, another process), and
an A/B between pools of different sizes measures memory, not scheduling. So the harness reads each
server's pool size once it is up and refuses the comparison when they differ.

Where the size comes from, first found wins:
  1. the server's /server_info (or older /get_server_info): `max_total_num_tokens`, at the top
     level or in its per-scheduler `internal_states`;
  2. the server's log: the scheduler's `max_total_num_tokens=N` line.
vLLM (the CPU peer) reports neither; it is sized in bytes from the same token count and left out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import requests

INFO_ROUTES = ("/server_info", "/get_server_info")
LOG_PATTERN = re.compile(r"max_total_num_tokens=(\d+)")


class KvPoolMismatch(RuntimeError):
    """Two servers of one A/B got KV pools of different sizes."""


def from_server_info(info: Any) -> int | None:
    """`max_total_num_tokens` from a /server_info answer (top level or internal_states)."""
    if not isinstance(info, Mapping):
        return None
    value = info.get("max_total_num_tokens")
    if isinstance(value, int) and value > 0:
        return value
    for state in info.get("internal_states") or []:
        value = from_server_info(state)
        if value is not None:
            return value
    return None


def from_log(text: str) -> int | None:
    """The last `max_total_num_tokens=N` the scheduler logged (one per start)."""
    found = LOG_PATTERN.findall(text)
    return int(found[-1]) if found else None


def pool_tokens(url: str, log_path: Path | None = None) -> tuple[int | None, str]:
    """(tokens, where it was read) for a running server; (None, "unknown") when nothing says."""
    for route in INFO_ROUTES:
        try:
            r = requests.get(url + route, timeout=30)
            tokens = from_server_info(r.json()) if r.status_code == 200 else None
        except (requests.RequestException, ValueError):
            tokens = None
        if tokens is not None:
            return tokens, route
    if log_path is not None:
        try:
            tokens = from_log(Path(log_path).read_text(errors="replace"))
        except OSError:
            tokens = None
        if tokens is not None:
            return tokens, "server log"
    return None, "unknown"


def check_same(pools: Mapping[str, int | None], requested: int) -> None:
    """Raise KvPoolMismatch when the known pool sizes differ (unknown ones cannot be compared)."""
    known = {name: n for name, n in pools.items() if n is not None}
    if len(set(known.values())) > 1:
        sizes = ", ".join(f"{name}: {n}" for name, n in known.items())
        raise KvPoolMismatch(f"KV pools differ between systems ({sizes}; requested {requested} tokens): "
                             "the A/B would compare memory, not scheduling. Lower --kv-tokens to what every "
                             "server gets, or give the servers the same free memory.")
