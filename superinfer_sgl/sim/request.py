"""A request inside the simulated server: where its KV lives and how far it has got."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from superinfer_sgl.rotasched.slo import Slo
from superinfer_sgl.rotasched.request_view import ReqView
from superinfer_sgl.rotasched.clock import ReqClock
from superinfer_sgl.sim.workload import RequestSpec


class Phase(enum.IntEnum):
    """Ordered like vLLM's lifecycle: anything from FINISHED on is done."""

    WAITING = 0  # in the waiting queue: never ran, retracted for recompute, or restored by a resume
    PREFILL = 1  # part-way through a chunked prefill
    RUNNING = 2  # decoding; KV on device
    ROTARY = 3  # paused; KV on host (rotated out, or swapped out)
    FINISHED = 4
    DROPPED = 5  # could never fit in device memory


@dataclass(slots=True, eq=False)
class SimReq:
    """Token bookkeeping. Invariant while RUNNING: kv == ctx - 1 (the last output token is the
    next decode input; its KV is written by that decode step). kv counts the shared prefix; alloc
    does not (the prefix is held once, by the radix cache)."""

    spec: RequestSpec
    clock: ReqClock  # the server's own per-request clock (rotasched.clock): VLT reads it
    phase: Phase = Phase.WAITING
    outputs: int = 0  # output tokens produced
    kv: int = 0  # tokens whose KV is on device (computed, or restored from host)
    alloc: int = 0  # device tokens allocated: kv rounded up to the policy's page size
    host: int = 0  # tokens with a copy on host (rotary KV, or DuplexKV's eager copy after a resume)
    prefill_iter: int = -1  # iteration of its last prefill step
    mixed_iter: int = -1  # iteration it last rode as a decode row of a mixed batch (prefill_iter too)
    shared: int = 0  # leading tokens read from the radix cache's shared prefix: never allocated
    restored: bool = False  # resumed into the radix tree, waiting for its one-token re-admission
    rotations: int = 0
    recomputes: int = 0
    view: ReqView | None = None  # a policy's cached view of it; the engine clears it on every move
    slo_s: tuple[float, float] = (0.0, 0.0)  # (clock.slo.ttft_s, clock.slo.tbt_s), read once

    @property
    def rid(self) -> str:
        return self.spec.rid

    @property
    def ctx(self) -> int:
        return self.spec.prompt_tokens + self.outputs

    @property
    def remaining(self) -> int:
        """Outputs left as the server sees them: up to its max_new_tokens (a request that may stop
        at EOS ends earlier, at its output_tokens)."""
        return self.spec.max_new_tokens - self.outputs

    @property
    def extend(self) -> int:
        """Tokens a prefill must still compute before the next token can be sampled."""
        return self.ctx - self.kv


_SLOS: dict[tuple[float, float, float], Slo] = {}


def new_req(spec: RequestSpec, prefix_cache: bool = True, delay: float = 0.0) -> SimReq:
    """`prefix_cache`: the server reuses spec.cached_tokens from its prefix cache (SGLang's radix
    tree); without one (vLLM V0's default) every prompt token is computed and allocated. `delay`:
    the request reaches the scheduler, whose clock (VLT) starts then, this long after spec.arrival."""
    key = (spec.ttft_slo, spec.tbt_slo, spec.weight)
    slo = _SLOS.get(key)
    if slo is None:
        slo = _SLOS[key] = Slo(spec.ttft_slo * 1000.0, spec.tbt_slo * 1000.0, spec.weight)
    shared = spec.cached_tokens if prefix_cache else 0
    return SimReq(spec, ReqClock(spec.rid, spec.arrival + delay, slo), kv=shared, shared=shared,
                  slo_s=(slo.ttft_s, slo.tbt_s))
