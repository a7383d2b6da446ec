"""The contract between the simulated server (engine.py) and a scheduling policy.

Each iteration the engine asks the policy for a Plan, applies its moves (retract, rotate out,
resume), then runs SGLang's PrefillAdder logic over `Plan.admit` in that order (stop at the first
request that does not fit), and runs a prefill batch if anything was admitted, else a decode step.
A decode step that runs out of device memory asks the policy for victims.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from superinfer_sgl.rotasched.output_share import OutputShare
from superinfer_sgl.rotasched.planner import CLIP_MAX_NEW_TOKENS, waiting_need
from superinfer_sgl.sim.profile import Profile
from superinfer_sgl.sim.request import SimReq
from superinfer_sgl.sim.settings import SimConfig


class SimState(Protocol):
    """What a policy may read of the simulated server (`engine.Simulator` is one). Read-only by
    contract: a policy changes nothing here, its moves go through the Plan it returns."""

    @property
    def now(self) -> float: ...
    @property
    def iteration(self) -> int: ...
    @property
    def config(self) -> SimConfig: ...
    @property
    def profile(self) -> Profile: ...
    @property
    def reqs(self) -> list[SimReq]: ...  # every request of the run
    @property
    def running(self) -> list[SimReq]: ...
    @property
    def waiting(self) -> list[SimReq]: ...
    @property
    def rotary(self) -> dict[str, SimReq]: ...
    @property
    def chunked(self) -> SimReq | None: ...  # the request mid chunked prefill
    @property
    def capacity(self) -> int: ...  # device KV tokens
    @property
    def free_tokens(self) -> int: ...
    @property
    def host_free_tokens(self) -> int: ...  # host KV tokens rotary requests may still take
    @property
    def new_token_ratio(self) -> float: ...
    @property
    def output_share(self) -> OutputShare: ...  # the server's Clocks.outputs
    @property
    def last_step(self) -> tuple[float, int, int, bool] | None: ...  # Simulator.last_step
    def page_round(self, tokens: int) -> int: ...


@dataclass(slots=True)
class Plan:
    admit: list[SimReq]  # offered to the prefill adder, in order (WAITING ones are considered)
    rotate_out: list[SimReq] = field(default_factory=list)  # RUNNING -> host
    resume: list[SimReq] = field(default_factory=list)  # ROTARY -> device
    retract: list[SimReq] = field(default_factory=list)  # RUNNING -> WAITING, recomputed later
    sched_s: float = 0.0  # CPU time of the decision, added to the iteration
    chunk_tokens: int | None = None  # this step's chunked-prefill size, if lower than the server's
    mix: bool = True  # with mixed_chunk: this step's prefill rides with the decode batch


@dataclass(frozen=True, slots=True)
class Victim:
    req: SimReq
    swap: bool  # True: move its KV to host; False: free it and recompute later


class Policy:
    """Defaults are stock SGLang's: page 1, conservative admission, retract-and-recompute."""

    name = "base"
    transfer = "free"  # engine moving KV for rotate_out/resume/swap: naive, duplex or free
    page_tokens = 1
    resume_to_running = False  # vLLM: a swapped-in request decodes at once; SGLang: re-admitted
    chunked_prefill = True  # SGLang chunks long prompts; vLLM V0 (no chunked prefill) does not
    prefix_cache = True  # SGLang's radix cache reuses shared prompt prefixes; vLLM V0's default does not
    retract_to_front = False  # SGLang re-queues a retracted request at the back; vLLM at the front

    def plan(self, sim: SimState) -> Plan:
        raise NotImplementedError

    # ---- admission (SGLang PrefillAdder, conservative) ----------------------------------------
    def reserve(self, sim: SimState, r: SimReq) -> float:
        """Decode tokens kept back for a running request (ratio 1 with ignore_eos)."""
        left = r.spec.max_new_tokens - r.outputs  # min(r.remaining, CLIP_MAX_NEW_TOKENS)
        return (left if left < CLIP_MAX_NEW_TOKENS else CLIP_MAX_NEW_TOKENS) * sim.new_token_ratio

    def admission_room(self, sim: SimState) -> float:
        reserve = self.reserve
        held = sum([reserve(sim, r) for r in sim.running])
        if sim.chunked is not None:
            held += reserve(sim, sim.chunked)
        return sim.free_tokens - held

    def admission_need(self, sim: SimState, r: SimReq) -> float:
        """SGLang's PrefillAdder: the extend plus the whole clipped reserve (ratio 1, an int)."""
        spec, outputs = r.spec, r.outputs
        return waiting_need(spec.prompt_tokens, outputs, r.kv, spec.max_new_tokens - outputs, 1)

    def max_running(self, sim: SimState) -> int:
        return sim.profile.server.max_running_requests

    def max_prefill_tokens(self, sim: SimState) -> int:
        return sim.profile.server.max_prefill_tokens

    # ---- decode out of memory (SGLang retract_decode) ----------------------------------------
    def decode_victims(self, sim: SimState, short: int) -> list[Victim]:
        """Retract fewest-output, then longest-input requests first; keep at least one."""
        order = retraction_order(sim.running)
        victims, freed = [], 0
        for r in order[: len(order) - 1]:
            if freed >= short:
                break
            victims.append(Victim(r, swap=False))
            freed += r.alloc
        return victims


def retraction_order(running: list[SimReq]) -> list[SimReq]:
    """SGLang's retract_decode order, the first to retract first: fewest outputs, then longest
    prompt (Python's sort is stable: ties keep the batch's order)."""
    return sorted(running, key=lambda r: (r.outputs, -r.spec.prompt_tokens))
