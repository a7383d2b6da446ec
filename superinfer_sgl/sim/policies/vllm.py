"""vLLM V0-style swapping: greedy admission (prompt blocks + 1% watermark, no decode reserve),
16-token pages, no chunked prefill, preempt the latest arrival by swapping its KV out with
per-page-per-layer copies; a static rule picks between new prefills and swap-ins.

waiting-first: prefill new requests whenever the queue head fits; swap in only otherwise.
swapped-first: swap in first (oldest swapped first); no new prefill while anything is swapped
               out (what vLLM 0.6's default scheduler does).
"""

from __future__ import annotations

from superinfer_sgl.sim.policies.base import Plan, Policy, SimState, Victim
from superinfer_sgl.sim.request import SimReq


WATERMARK = 0.01  # vLLM V0 block manager watermark
MAX_NUM_SEQS = 256  # vLLM default
MAX_BATCHED_TOKENS = 32768  # V0 without chunked prefill: max(max_model_len, 2048), 32k models


class VllmSwap(Policy):
    transfer = "naive"
    page_tokens = 16
    resume_to_running = True
    chunked_prefill = False
    prefix_cache = False
    retract_to_front = True

    def __init__(self, swapped_first: bool) -> None:
        self.swapped_first = swapped_first
        self.name = "vllm-swap-" + ("swapped-first" if swapped_first else "waiting-first")

    def _room(self, sim: SimState) -> int:
        return sim.free_tokens - int(WATERMARK * sim.capacity)

    def admission_room(self, sim: SimState) -> float:
        return self._room(sim)

    def admission_need(self, sim: SimState, r: SimReq) -> float:
        return sim.page_round(r.ctx) - r.alloc

    def max_running(self, sim: SimState) -> int:
        return MAX_NUM_SEQS

    def max_prefill_tokens(self, sim: SimState) -> int:
        return MAX_BATCHED_TOKENS

    def plan(self, sim: SimState) -> Plan:
        if self.swapped_first:
            resume = self._swap_ins(sim)
            return Plan(admit=[] if len(resume) < len(sim.rotary) else sim.waiting, resume=resume)
        head = sim.waiting[0] if sim.waiting else None
        if head is not None and self.admission_need(sim, head) <= self._room(sim):
            return Plan(admit=sim.waiting)
        return Plan(admit=[], resume=self._swap_ins(sim))

    def _swap_ins(self, sim: SimState) -> list[SimReq]:
        room, slots = self._room(sim), MAX_NUM_SEQS - len(sim.running)
        out = []
        for r in sim.rotary.values():
            need = sim.page_round(r.host + 1)  # its KV plus the slot of the next decode
            if need > room or len(out) >= slots:
                break  # FCFS over the swapped queue
            out.append(r)
            room -= need
        return out

    def decode_victims(self, sim: SimState, short: int) -> list[Victim]:
        """Preempt from the tail of the running queue (latest arrival) by swapping out."""
        order = sorted(sim.running, key=lambda r: r.spec.arrival)
        victims, freed = [], 0
        while order[1:] and freed < short:
            r = order.pop()
            victims.append(Victim(r, swap=True))
            freed += r.alloc
        return victims

