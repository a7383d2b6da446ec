"""Idealised reference: preemption and KV moves cost nothing, output lengths are known, and every
iteration runs the least-slack requests that fit in device memory.

Slack: a request without tokens has until arrival + TTFT SLO, minus its prefill time alone; a
started one until last token + TBT SLO, minus one decode step. Requests that already missed their
TTFT go last (oldest first); ties go to the fewest remaining tokens (known lengths). Batches stay
non-mixed, as for every policy: an iteration prefills the chosen waiting requests that are more
urgent than every started one or already late, plus as many others as fit in the started
requests' smallest slack (so a prefill never costs a running request its next gap); with none,
the chosen started requests decode.
Not a proven bound: a reference for what scheduling alone could gain under the same cost model.
"""

from __future__ import annotations

from superinfer_sgl.sim.policies.base import Plan, Policy, SimState, Victim
from superinfer_sgl.sim.request import Phase, SimReq


class Oracle(Policy):
    name = "oracle"
    transfer = "free"
    resume_to_running = True

    def admission_room(self, sim: SimState) -> float:
        return sim.free_tokens

    def admission_need(self, sim: SimState, r: SimReq) -> float:
        return r.extend

    def _key(self, sim: SimState, r: SimReq, step_s: float) -> tuple[int, float, int]:
        c, spec = r.clock, r.spec
        if c.last_token is None:
            slack = spec.arrival + spec.ttft_slo - sim.profile.step.prefill_alone(r.extend) - sim.now
            if slack < 0:
                return (1, spec.arrival, spec.output_tokens - r.outputs)
        else:
            slack = c.last_token + spec.tbt_slo - step_s - sim.now
        return (0, slack, spec.output_tokens - r.outputs)

    def plan(self, sim: SimState) -> Plan:
        step_s = sim.profile.step.seconds(decode_reqs=max(1, len(sim.running)),
                                          decode_context=sum(r.kv for r in sim.running))
        items = sim.running + list(sim.rotary.values()) + sim.waiting
        keys = {id(r): self._key(sim, r, step_s) for r in items}
        items.sort(key=lambda r: keys[id(r)])
        room, chosen = sim.capacity, []
        for r in items:
            need = r.ctx + 1
            if need <= room:
                chosen.append(r)
                room -= need
        keep = {id(r) for r in chosen}
        out = [r for r in sim.running if id(r) not in keep and r.outputs > 0]
        admit = self._prefills(sim, chosen, keys)
        if admit:
            return Plan(admit=admit, rotate_out=out)
        resume = [r for r in chosen if r.phase is Phase.ROTARY]
        return Plan(admit=[], rotate_out=out, resume=resume)

    def _prefills(self, sim: SimState, chosen: list[SimReq], keys: dict) -> list[SimReq]:
        waiting = [r for r in chosen if r.phase is Phase.WAITING]
        if not waiting:
            return []
        started = [keys[id(r)][1] for r in chosen if r.phase is not Phase.WAITING]
        slack = min(started, default=float("inf"))
        admit, tokens, pairs = [], 0, 0.0
        for r in waiting:
            late, own = keys[id(r)][:2]
            urgent = late or own <= slack  # already late, or more urgent than every started one
            t = sim.profile.step.seconds(tokens + r.extend, pairs + r.extend**2 / 2.0, len(admit) + 1)
            if not urgent and t > slack:
                continue  # too long for the slack now; it goes once urgent
            admit.append(r)
            tokens, pairs = tokens + r.extend, pairs + r.extend**2 / 2.0
        return admit

    def decode_victims(self, sim: SimState, short: int) -> list[Victim]:
        step_s = sim.profile.step.seconds(decode_reqs=len(sim.running))
        order = sorted(sim.running, key=lambda r: self._key(sim, r, step_s), reverse=True)
        victims, freed = [], 0
        for r in order[:-1]:
            if freed >= short:
                break
            victims.append(Victim(r, swap=True))
            freed += r.alloc
        return victims
