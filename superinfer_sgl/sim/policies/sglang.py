"""Stock SGLang: FCFS, conservative admission (decode reserve), retract-and-recompute on decode
OOM; and SGLang's priority scheduling with preemption (--enable-priority-scheduling)."""

from __future__ import annotations

from superinfer_sgl.sim.policies.base import Plan, Policy, SimState
from superinfer_sgl.sim.request import Phase, SimReq


class SGLangFCFS(Policy):
    name = "sglang"

    def plan(self, sim: SimState) -> Plan:
        return Plan(admit=sim.waiting)


class SGLangPriority(Policy):
    """Higher `priority` first (ties by arrival). A waiting request that does not fit retracts
    running requests whose priority is lower by at least `threshold`, lowest first, and they
    recompute (SGLang's preempt_to_schedule). With equal priorities this is stock FCFS."""

    name = "sglang-priority"
    threshold = 10  # --priority-scheduling-preemption-threshold default

    def plan(self, sim: SimState) -> Plan:
        queue = sorted(sim.waiting, key=lambda r: (-r.spec.priority, r.spec.arrival))
        room = self.admission_room(sim)
        victims: list[SimReq] = []
        for r in queue:
            need = self.admission_need(sim, r)
            if need <= room:
                room -= need
                continue
            freed = self._preempt_for(sim, r, need - room, victims)
            if freed < need - room:
                break  # head-of-line: nothing more is admitted this iteration
            room += freed - need
        return Plan(admit=queue, retract=victims)

    def _preempt_for(self, sim: SimState, r: SimReq, short: float, victims: list[SimReq]) -> float:
        cands = [v for v in sim.running if v.phase is Phase.RUNNING and v not in victims
                 and v.spec.priority <= r.spec.priority - self.threshold]
        cands.sort(key=lambda v: (v.spec.priority, -v.spec.arrival))
        chosen, freed = [], 0.0
        for v in cands:
            if freed >= short:
                break
            chosen.append(v)
            freed += v.alloc + self.reserve(sim, v)
        if freed < short:
            return 0.0
        victims.extend(chosen)
        return freed
