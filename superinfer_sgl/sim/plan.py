"""Capacity planning: how many replicas a workload of SLO classes needs, per scheduling policy.

A replica's capacity for a mix is the highest total rate at which *every* class still has at least
`target` of its requests meeting both SLOs (sim/capacity.py's first crossing). A load balancer that
spreads a Poisson stream over N replicas gives each a Poisson stream of rate R/N with the same mix,
so R needs ceil(R / capacity) replicas. The consolidation question (one shared cluster for chat and
batch, or one cluster per class) compares ceil(R / capacity(mix)) with the sum over classes of
ceil(R_class / capacity(class alone)).

Requests: Poisson arrivals, each request's class drawn by the classes' shares of the rate,
ShareGPT-like lengths (sim/workload.py) or lengths drawn from a recorded set (`Population`: a live
run's requests, sim/capacity_validate.py). For SGLang's priority scheduling a class's priority
follows its TTFT SLO (tighter: higher), as the A/B harness sends it; the goodput policy uses each
class's weight.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from superinfer_sgl.sim.capacity import Capacity, CapacityGrid, find_capacity
from superinfer_sgl.sim.engine import SimConfig, Simulator
from superinfer_sgl.sim.metrics import request_outcomes
from superinfer_sgl.sim.policies import make_policy
from superinfer_sgl.sim.profile import Profile, resolve_profile
from superinfer_sgl.sim.runner import Job
from superinfer_sgl.sim.workload import SHAREGPT_LIKE, RequestSpec, Workload, poisson_arrivals

PRIORITY_STEP = 10  # SGLang preempts only for a priority at least this much higher (its default threshold)


@dataclass(frozen=True)
class MixClass:
    """One SLO class of the workload and its arrival rate (req/s) in the whole cluster."""

    name: str
    rate: float
    ttft_s: float
    tbt_s: float
    weight: float = 1.0

    def __post_init__(self) -> None:
        for what, v in (("rate", self.rate), ("ttft", self.ttft_s), ("tbt", self.tbt_s), ("weight", self.weight)):
            if not 0.0 < v < math.inf:  # (NaN too)
                raise ValueError(f"class {self.name!r}: {what} must be a finite number > 0, got {v}")
        if not self.name:
            raise ValueError("a class needs a name")

    @classmethod
    def parse(cls, text: str) -> MixClass:
        """`chat:rate=20,ttft_ms=1000,tbt_ms=50[,weight=2]`."""
        name, _, rest = text.partition(":")
        fields = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        known = {"rate", "ttft_ms", "tbt_ms", "weight"}
        if not name or set(fields) - known or not {"rate", "ttft_ms", "tbt_ms"} <= set(fields):
            raise ValueError(f"class {text!r}: expected NAME:rate=R,ttft_ms=T,tbt_ms=B[,weight=W]")
        try:
            values = [float(fields[k]) for k in ("rate", "ttft_ms", "tbt_ms")] + [float(fields.get("weight", 1.0))]
        except ValueError:
            raise ValueError(f"class {text!r}: rate, ttft_ms, tbt_ms and weight are numbers") from None
        rate, ttft_ms, tbt_ms, weight = values
        return cls(name, rate, ttft_ms / 1000.0, tbt_ms / 1000.0, weight)


@dataclass(frozen=True)
class Population:
    """Request lengths drawn with replacement from recorded requests: per row its prompt and output
    tokens and the prompt tokens the prefix cache serves (a chat template's shared prefix).
    `bounds`, for requests that could stop at EOS: per row the max_new_tokens the server saw (the
    output is what the model decoded); empty: fixed-length requests."""

    rows: tuple[tuple[int, int, int], ...]
    bounds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.rows and all(p > c >= 0 and o >= 1 for p, o, c in self.rows), self.rows[:3]
        assert not self.bounds or (len(self.bounds) == len(self.rows) and all(
            b >= o for b, (_, o, _) in zip(self.bounds, self.rows))), "one bound >= the output per row"

    def sample(self, rng: random.Random) -> tuple[int, int, int, int]:
        """(prompt, output, cached, max_new_tokens); max_new_tokens 0: the output (fixed length)."""
        i = rng.randrange(len(self.rows))
        return (*self.rows[i], self.bounds[i] if self.bounds else 0)


def mix_workload(classes: Sequence[MixClass], rate: float, duration: float, seed: int,
                 population: Population | None = None) -> tuple[Workload, dict[str, str]]:
    """`rate` req/s in all, classes drawn by their share of the rate, lengths ShareGPT-like or
    drawn from `population`; rid -> class name."""
    rng = random.Random(seed)
    total = sum(c.rate for c in classes)
    by_ttft = sorted({c.ttft_s for c in classes}, reverse=True)
    specs, names = [], {}
    for i, t in enumerate(poisson_arrivals(rate, duration, rng)):
        c = rng.choices(classes, weights=[k.rate / total for k in classes])[0]
        if population is None:
            (p, o), cached, bound = SHAREGPT_LIKE.sample(rng), 0, 0
        else:
            p, o, cached, bound = population.sample(rng)
        rid = f"m{i}"
        specs.append(RequestSpec(rid, t, p, o, c.ttft_s, c.tbt_s, PRIORITY_STEP * by_ttft.index(c.ttft_s),
                                 cached_tokens=cached, weight=c.weight, max_new_tokens=bound))
        names[rid] = c.name
    return Workload(tuple(specs), f"mix of {', '.join(c.name for c in classes)} (seed {seed}, {rate:g} req/s)"), names


@dataclass(frozen=True)
class PlanSpec:
    """What one replica is: a profile (a name, a path or a Profile with its server limits set), the
    classes, the request lengths (None: ShareGPT-like), and per policy its SimConfig (absent: the
    policy as shipped with mixed chunk, what a planning run assumes)."""

    profile: str | Profile
    classes: tuple[MixClass, ...]
    duration: float = 120.0
    seed: int = 0
    seeds: int = 1
    population: Population | None = None
    configs: Mapping[str, SimConfig] | None = None

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"classes need distinct names, got {names}")
        if self.seeds < 1 or not 0.0 < self.duration < math.inf:
            raise ValueError(f"need seeds >= 1 and a finite duration > 0 (got {self.seeds}, {self.duration})")

    def config(self, policy: str) -> SimConfig:
        """The settings a policy is planned with: the servers' (`configs`), else SGLang's mixed chunk
        on, or off for POLICY:no-mix (stock SGLang ships it off; on long prompts it does better so)."""
        given = (self.configs or {}).get(policy)
        eos = bool(self.population and self.population.bounds)  # the server saw bounds, not lengths
        return given if given is not None else Job("plan", base_policy(policy), mixed_chunk=mixed_chunk(policy),
                                                   ignore_eos=not eos).config()

    def worst_class_attainment(self, policy: str, classes: tuple[MixClass, ...], rate: float) -> float:
        """The lowest joint attainment of any class at `rate`, pooled over the seeds."""
        profile = self.profile if isinstance(self.profile, Profile) else resolve_profile(self.profile)
        config = self.config(policy)
        # bounds mean the server saw only max_new_tokens: a fixed-length config would reserve them all
        assert not (self.population and self.population.bounds and config.ignore_eos), policy
        met: dict[str, list[int]] = {c.name: [0, 0] for c in classes}
        for s in range(self.seed, self.seed + self.seeds):
            wl, names = mix_workload(classes, rate, self.duration, s, self.population)
            sim = Simulator(wl, profile, make_policy(base_policy(policy)), config).run()
            for row in request_outcomes(sim):
                m = met[names[str(row["rid"])]]
                m[0] += bool(row["ttft_met"] and row["tbt_met"])
                m[1] += 1
        empty = [name for name, (_, n) in met.items() if n == 0]
        if empty:  # not measured is not met: a rare class could otherwise pass unseen
            raise ValueError(f"class {', '.join(empty)}: no request at {rate:g} req/s in {self.duration:g} s x "
                             f"{self.seeds} seed(s); give a longer --duration or more --seeds")
        return min(a / n for a, n in met.values())


NO_MIX = ":no-mix"


def base_policy(policy: str) -> str:
    """The simulator's policy of a planned one (POLICY or POLICY:no-mix)."""
    return policy.removesuffix(NO_MIX)


def mixed_chunk(policy: str) -> bool:
    """Whether a planned policy runs with SGLang's mixed chunk (all but POLICY:no-mix)."""
    return not policy.endswith(NO_MIX)


def _attainment(args: tuple[PlanSpec, str, tuple[MixClass, ...], float]) -> float:
    spec, policy, classes, rate = args
    return spec.worst_class_attainment(policy, classes, rate)


def replica_capacity(spec: PlanSpec, policy: str, classes: tuple[MixClass, ...], grid: CapacityGrid,
                     processes: int = 1) -> Capacity:
    """Highest total rate one replica serves with every class at the target (`capacity_req_s` None:
    below the grid; `censored` "above": at least the grid's top, which then over-provisions)."""
    def measure(rates: Sequence[float]) -> list[float]:
        args = [(spec, policy, classes, r) for r in rates]
        if processes <= 1 or len(args) == 1:
            return [_attainment(a) for a in args]
        with ProcessPoolExecutor(min(processes, len(args))) as pool:
            return list(pool.map(_attainment, args))

    return find_capacity(measure, grid, batch=max(1, processes))


def replicas(rate: float, capacity: float | None) -> int | None:
    """Replicas for `rate` at `capacity` each; None when no rate of the grid met the target."""
    return None if not capacity else math.ceil(rate / capacity - 1e-9)


def plan(spec: PlanSpec, policies: Sequence[str], grid: CapacityGrid, processes: int = 1) -> list[dict]:
    """Per policy: the mix's capacity per replica and replicas for the shared cluster; each class's
    capacity alone and replicas for separate clusters."""
    total = sum(c.rate for c in spec.classes)
    rows = []
    for pol in policies:
        shared = replica_capacity(spec, pol, spec.classes, grid, processes)
        alone: dict[str, Capacity] = {}
        if len(spec.classes) > 1:
            alone = {c.name: replica_capacity(spec, pol, (c,), grid, processes) for c in spec.classes}
        each = [replicas(c.rate, alone[c.name].capacity_req_s) for c in spec.classes] if alone else []
        rows.append({"policy": pol, "rate_req_s": total, "target": grid.target,
                     "capacity_per_replica_req_s": shared.capacity_req_s, "censored": shared.censored,
                     "replicas_shared": replicas(total, shared.capacity_req_s),
                     "capacity_alone_req_s": {k: c.capacity_req_s for k, c in alone.items()},
                     "censored_alone": {k: c.censored for k, c in alone.items() if c.censored},
                     # None: some class alone met the target at no rate of the grid
                     "replicas_separate": None if None in each or not each else sum(each)})  # type: ignore[arg-type]
    return rows


def plan_table(rows: list[dict]) -> str:
    """Markdown. A capacity at the grid's top is a floor ("at least"), and the replica counts built
    on it are at most; "below grid": no rate met the target, so no count."""
    lines = ["| policy | capacity per replica (req/s) | replicas, shared | replicas, one cluster per class |",
             "|---|---|---|---|"]
    for r in rows:
        cap, top = r["capacity_per_replica_req_s"], r["censored"] == "above"
        cell = "below grid" if cap is None else (f">= {cap:.2f} (grid max)" if top else f"{cap:.2f}")
        shared = "-" if r["replicas_shared"] is None else f"{'<= ' if top else ''}{r['replicas_shared']}"
        sep = r["replicas_separate"]
        separate = ("-" if sep is None and not r["capacity_alone_req_s"] else "below grid" if sep is None
                    else f"{'<= ' if r['censored_alone'] else ''}{sep}")
        lines.append(f"| {r['policy']} | {cell} | {shared} | {separate} |")
    return "\n".join(lines)


__all__ = ["MixClass", "NO_MIX", "PlanSpec", "Population", "base_policy", "mix_workload", "mixed_chunk", "plan", "plan_table",
           "replica_capacity", "replicas"]
