"""KV precision by SLO class: one RotationEngine per host format in use, behind the engine's API.

Each format of --rotary-kv-dtype and of the classes' "rotary_kv_dtype" (config.rotary_kv_formats)
gets a host pool of its own (HostKVPool.for_formats) and a RotationEngine over it and the one device
pool. A request is routed by its format, given to track(rid, kv_format) (the runtime knows the
request's class; a rid never tracked, and rid None, take the default format); a HostKV by its
kv_format, which this class stamps on every HostKV it hands out and strips before handing one back
to its engine (the engines see plain HostKVs, so their prefetch tables and mirrors are untouched).

rotate() with work in one format is that engine's rotate(); with several, the outs of each format
are launched first (one engine call each), then the ins, each in-engine call waiting for `in_after`
and, with in_after_out, for every out copy of the call. All or nothing: every format's part is
checked first (its arguments, its pool's room: `RotationEngine.blocks_short`), so a full pool raises
HostPoolFull naming its format before any copy, counter or mirror has moved. Only a copy that fails
once launched frees the HostKVs already saved in this call before the error propagates.

Accounting: the engines' counters summed (counters()), and per (SLO class, format) the host bytes
that HostKVs hold now (host_bytes_held) and the bytes rotated out (bytes_out_by): the series
"host bytes by class and dtype".
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from superinfer_sgl.duplexkv.copy_timing import CopyTimer
from superinfer_sgl.duplexkv.device_pool import DevicePoolView
from superinfer_sgl.duplexkv.engine import DEFAULT_MAX_PROGRAMS, RotateIn, RotateOut, RotationEngine
from superinfer_sgl.duplexkv.host_pool import HostKV, HostKVPool, HostPoolFull
from superinfer_sgl.duplexkv.streams import After, RotationHandle, as_events

NO_CLASS = "default"  # the class label of requests without one


class TimersSummed:
    """Every format's CopyTimer read as one (copy_metrics.publish reads `totals`). Each engine times
    its own copies; two formats' copies of one call running at once are not counted as overlap."""

    def __init__(self, timers: list[CopyTimer]) -> None:
        self.timers = timers

    def totals(self) -> dict[str, float]:
        total: Counter[str] = Counter()
        for timer in self.timers:
            total.update(timer.totals())
        return dict(total)


class EnginesByFormat:
    def __init__(self, device_pool: DevicePoolView, host_pools: Mapping[str, HostKVPool], default: str,
                 transfer: str = "auto", max_programs: int | None = DEFAULT_MAX_PROGRAMS,
                 ring: dict[str, int] | None = None, class_formats: Mapping[str, str] | None = None) -> None:
        """class_formats: SLO class -> its format (config.class_rotary_kv_dtypes), for track_class."""
        if default not in host_pools:
            raise ValueError(f"the default format {default!r} has no host pool (have {sorted(host_pools)})")
        for fmt, pool in host_pools.items():
            if pool.kv_format != fmt:
                raise ValueError(f"host pool for {fmt!r} holds {pool.kv_format!r} blocks")
        self.default = default
        self.class_formats = dict(class_formats or {})
        self.engines = {fmt: RotationEngine(device_pool, pool, transfer, max_programs, ring)
                        for fmt, pool in host_pools.items()}
        self.device_pool = device_pool
        self._rids: dict[str, tuple[str, str]] = {}  # rid -> (format, class label)
        self._held: dict[HostKV, list[tuple[str, str, int]]] = defaultdict(list)  # stamped HostKV -> (cls, fmt, bytes)
        self.host_bytes_held: Counter[tuple[str, str]] = Counter()
        self.bytes_out_by: Counter[tuple[str, str]] = Counter()

    # ---- the default engine's face (startup logging, the rotation budget, the link probe)
    @property
    def primary(self) -> RotationEngine:
        return self.engines[self.default]

    @property
    def host_pool(self) -> HostKVPool:
        return self.primary.host_pool

    @property
    def transfer(self) -> str:
        return self.primary.transfer

    @property
    def copy_timer(self) -> "TimersSummed":
        return TimersSummed([e.copy_timer for e in self.engines.values()])

    def room_blocks(self, enough: int) -> int:
        """The least room of any format's pool (`RotationEngine.room_blocks`): a request rotates out
        to its class's pool, which the policy does not tell apart."""
        return min(e.room_blocks(enough) for e in self.engines.values())

    def __getattr__(self, name: str) -> Any:
        """The engines' counters (bytes_out, bytes_eager_out, ...) summed."""
        if name.startswith(("bytes_", "rotations_", "prefetch", "eager_", "mirror_")):
            return sum(getattr(e, name) for e in self.__dict__["engines"].values())
        raise AttributeError(name)

    def counters(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for e in self.engines.values():
            total.update(e.counters())
        return dict(total)

    # ---- routing
    def track(self, rid: str, kv_format: str | None = None, slo_class: str | None = None) -> None:
        """Give `rid` a mirror in the engine of its format (its class's precision; None: the format it
        was tracked with, else the default). Idempotent; a rid's format never changes while tracked."""
        known = self._rids.get(rid)
        fmt = kv_format or (known[0] if known else self.default)  # None: as tracked before
        if fmt not in self.engines:
            raise ValueError(f"no host pool for format {fmt!r} (have {sorted(self.engines)})")
        if known is not None and known[0] != fmt:
            raise ValueError(f"request {rid!r} rotates at {known[0]}, not {fmt}")
        self._rids[rid] = (fmt, slo_class or (known[1] if known else NO_CLASS))
        self.engines[fmt].track(rid)

    def track_class(self, rid: str, slo_class: str | None) -> None:
        """track() at the precision of `rid`'s SLO class (an unknown class or None: the default)."""
        self.track(rid, self.class_formats.get(slo_class) if slo_class is not None else None, slo_class)

    def format_of(self, rid: str | None) -> str:
        return self._rids[rid][0] if rid in self._rids else self.default

    def _engine_of(self, hk: HostKV) -> RotationEngine:
        return self.engines[self.default if hk.kv_format is None else hk.kv_format]

    def _stamp(self, hk: HostKV, fmt: str, cls: str) -> HostKV:
        out = dataclasses.replace(hk, kv_format=fmt)
        nbytes = len(hk.block_ids) * self.engines[fmt].host_pool.bytes_per_block
        self._held[out].append((cls, fmt, nbytes))
        self.host_bytes_held[cls, fmt] += nbytes
        return out

    @staticmethod
    def _strip(hk: HostKV) -> HostKV:
        return dataclasses.replace(hk, kv_format=None)

    # ---- the engine's API, routed
    def rotate(self, out: Iterable[RotateOut | tuple] = (), inn: Iterable[RotateIn | tuple] = (),
               after: After = None, in_after: After = None, in_after_out: bool = False) -> RotationHandle:
        outs = [RotateOut(*o) for o in out]
        ins = [RotateIn(*i) for i in inn]
        out_fmt = [self.format_of(o.rid) for o in outs]
        in_fmt = [self.default if i.host_kv.kv_format is None else i.host_kv.kv_format for i in ins]
        stripped = [RotateIn(self._strip(i.host_kv), i.slots) for i in ins]
        saved: list[HostKV | None] = [None] * len(outs)
        events = []
        fmts = list(dict.fromkeys(out_fmt + in_fmt))
        if len(fmts) == 1:  # one engine: its own rotate, its own ordering
            try:
                h = self.engines[fmts[0]].rotate(out=outs, inn=stripped, after=after, in_after=in_after,
                                                 in_after_out=in_after_out)
            except HostPoolFull as full:
                full.kv_format = fmts[0]
                raise
            return RotationHandle(tuple(self._commit(outs, out_fmt, h.saved)), h.events)
        for fmt in fmts:
            short = self.engines[fmt].blocks_short([o for o, f in zip(outs, out_fmt) if f == fmt],
                                                   [s for s, f in zip(stripped, in_fmt) if f == fmt])
            if short:
                full = HostPoolFull(f"the {fmt} host pool is {short} blocks short")
                full.kv_format = fmt
                raise full
        try:
            for fmt in dict.fromkeys(out_fmt):
                idx = [i for i, f in enumerate(out_fmt) if f == fmt]
                h = self.engines[fmt].rotate(out=[outs[i] for i in idx], after=after)
                for i, hk in zip(idx, h.saved):
                    saved[i] = hk
                events += h.events
            waits = [*as_events(in_after), *(events if in_after_out else [])]
            for fmt in dict.fromkeys(in_fmt):
                h = self.engines[fmt].rotate(inn=[s for s, f in zip(stripped, in_fmt) if f == fmt], after=after,
                                             in_after=waits)
                events += h.events
        except BaseException:  # a copy failed once launched (the checks above passed)
            for i, hk in enumerate(saved):
                if hk is not None:
                    self.engines[out_fmt[i]].free(hk)
            raise
        return RotationHandle(tuple(self._commit(outs, out_fmt, tuple(saved))), tuple(events))

    def _commit(self, outs: list[RotateOut], fmts: list[str], saved: tuple) -> list[HostKV]:
        result = []
        for o, fmt, hk in zip(outs, fmts, saved):
            cls = self._rids[o.rid][1] if o.rid in self._rids else NO_CLASS
            self.bytes_out_by[cls, fmt] += o.num_tokens * self.engines[fmt].host_pool.bytes_per_token
            result.append(self._stamp(hk, fmt, cls))
        return result

    def save(self, slots: torch.Tensor, kv_format: str | None = None) -> HostKV:
        fmt = self.default if kv_format is None else kv_format
        return self._stamp(self.engines[fmt].save(slots), fmt, NO_CLASS)

    def save_request(self, rid: str, slots: torch.Tensor, num_tokens: int) -> HostKV:
        h = self.rotate(out=[RotateOut(rid, slots, num_tokens)])
        h.synchronize()
        return h.saved[0]

    def load(self, host_kv: HostKV, slots: torch.Tensor) -> None:
        self._engine_of(host_kv).load(self._strip(host_kv), slots)

    def free(self, host_kv: HostKV) -> None:
        self._engine_of(host_kv).free(self._strip(host_kv))
        held = self._held.get(host_kv)
        if held:
            cls, fmt, nbytes = held.pop()
            self.host_bytes_held[cls, fmt] -= nbytes
            if not held:
                del self._held[host_kv]

    def prefetch(self, host_kv: HostKV, slots: torch.Tensor, after: After = None,
                 in_after: After = None) -> RotationHandle:
        return self._engine_of(host_kv).prefetch(self._strip(host_kv), slots, after, in_after)

    def cancel_prefetch(self, host_kv: HostKV) -> None:
        self._engine_of(host_kv).cancel_prefetch(self._strip(host_kv))

    def is_prefetched(self, host_kv: HostKV) -> bool:
        return self._engine_of(host_kv).is_prefetched(self._strip(host_kv))

    def untrack(self, rid: str) -> None:
        self.engines[self.format_of(rid)].untrack(rid)
        self._rids.pop(rid, None)

    def untrack_all(self) -> None:
        for engine in self.engines.values():
            engine.untrack_all()
        self._rids.clear()

    def sync_full_blocks(self, rid: str, slots: torch.Tensor, num_tokens: int, after: After = None,
                         max_blocks: int | None = None) -> int:
        return self.engines[self.format_of(rid)].sync_full_blocks(rid, slots, num_tokens, after, max_blocks)

    def invalidate(self, rid: str, from_token: int) -> None:
        self.engines[self.format_of(rid)].invalidate(rid, from_token)

    def keep_as_mirror(self, rid: str, host_kv: HostKV, valid_tokens: int | None = None) -> int:
        return self._engine_of(host_kv).keep_as_mirror(rid, self._strip(host_kv), valid_tokens)

    def drop_mirrors(self, n_blocks: int, exclude: Iterable[str] = (), kv_format: str | None = None) -> int:
        return self.engines[self.default if kv_format is None else kv_format].drop_mirrors(n_blocks, exclude)

    def synced_tokens(self, rid: str) -> int:
        return self.engines[self.format_of(rid)].synced_tokens(rid)

    def use_transfer(self, transfer: str) -> None:
        for e in self.engines.values():
            e.use_transfer(transfer)

    def quiesce(self) -> None:
        for e in self.engines.values():
            e.quiesce()

    def check_invariants(self) -> None:
        for e in self.engines.values():
            e.check_invariants()
        assert all(v >= 0 for v in self.host_bytes_held.values()), self.host_bytes_held
