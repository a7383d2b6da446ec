"""The one stand-in for SGLang's `Req` in unit tests: the fields our integration layer reads.

`kv` is the request's KV bookkeeping as `rotation` reads it (req_pool_idx, holds_kv,
kv_allocated_len); `sampling_params` what the SLO clock and the decode reserve read; `time_stats`
the waiting-queue stamp SGLang's waiting timeout reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


def sampling(max_new_tokens: int = 10, ignore_eos: bool = True, custom_params: Any = None) -> SimpleNamespace:
    return SimpleNamespace(custom_params=custom_params, ignore_eos=ignore_eos, max_new_tokens=max_new_tokens)


@dataclass
class FakeTimeStats:
    wait_queue_entry_time: float = 0.0

    def set_wait_queue_entry_time(self, ts: float | None = None) -> None:
        self.wait_queue_entry_time = ts or time.perf_counter()


@dataclass
class FakeReq:
    rid: str
    origin_input_ids: list[int] = field(default_factory=lambda: [5, 6, 7])
    output_ids: list[int] = field(default_factory=lambda: [1, 2])
    kv: Any = field(default_factory=lambda: SimpleNamespace(req_pool_idx=1, holds_kv=True, kv_allocated_len=0))
    sampling_params: Any = field(default_factory=sampling)
    extra_key: Any = None
    cache_salt: Any = None
    time_stats: FakeTimeStats = field(default_factory=FakeTimeStats)
    to_finish: Any = None

    def finished(self) -> bool:
        return False

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)
