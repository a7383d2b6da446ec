"""SLO capacity: the highest request rate at which at least `target` of requests meet both their TTFT
and TBT SLOs (DistServe's goodput framing), found per policy by a grid scan and then bisection.

Attainment curves are not monotone: a stock scheduler past its knee can fall to 51% at one rate
and climb back to 92% at the next (arrival bursts and queue collapse, not capacity). Capacity here
is the *first crossing*: the highest rate r such that every scanned rate up to r meets the target.
Grid rates above the first failure that pass again are reported (`passes_above`), never counted:
an operator provisioning at such a rate would sit one burst away from the cliff below it.

The search itself is pure (`find_capacity` takes any rate -> attainment function, batched so a
caller can measure several rates at once); `policy_capacity` measures with the simulator. Its
answer depends on the grid alone (`probes` included), never on the batch: where a curve wavers
around the target inside a bracket, which rates get probed decides which crossing is found, so the
probes must not follow the number of worker processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from superinfer_sgl.sim.runner import Job, run_jobs

# measure(rates) -> attainment at each rate (share of requests meeting both SLOs, 0..1)
Measure = Callable[[Sequence[float]], Sequence[float]]

# What "meets its TBT SLO" means (the summary's joint attainment under each rule): "gaps", at least
# 90% of its inter-token gaps within the SLO (the server's own rule, rotasched/clock.py); "tpot",
# its mean time per output token within it (DistServe's goodput, SGLang's bench_serving TPOT).
SLO_RULES = {"gaps": "both_attainment", "tpot": "joint_tpot_attainment"}
# Its --help text, for every command line that offers the choice (argparse: %% is a percent sign).
SLO_RULE_HELP = ("what meeting the TBT SLO means: gaps (the default, the server's rule) = at least 90%% of a "
                 "request's inter-token gaps within it; tpot = its mean time per output token within it "
                 "(DistServe's goodput, SGLang bench_serving's TPOT)")


MIN_RATE = 1e-3  # req/s: rates are rounded to 6 decimals, so a grid needs room above that
MIN_RESOLUTION = 1e-4  # finer than the simulator's answer means anything


@dataclass(frozen=True)
class CapacityGrid:
    """Where to look: a geometric grid from `lo` to `hi` (ratio `growth`), then bisection of the
    first crossing's bracket until it is narrower than `resolution` (a fraction of the rate)."""

    target: float = 0.9
    lo: float = 0.5
    hi: float = 64.0
    growth: float = 1.25
    resolution: float = 0.02
    stop_after: int = 2  # consecutive failing grid rates after which higher rates are not scanned
    # When `lo` itself fails, rates below it (lo / growth**k, k = 1..extend_below) are scanned
    # downward until one passes, so that a capacity under a mis-guessed grid (a live server slower
    # than its calibration said) is found rather than reported as "below".
    extend_below: int = 0
    # Evenly spaced rates probed per bisection round (1: bisection; 2: thirds, which keeps two
    # worker processes busy). Part of the search, not of its parallelism: see the module doc.
    probes: int = 1

    def __post_init__(self) -> None:
        """ValueError (a usage error at the command line) for a grid no search can run on."""
        checks = ((0.0 < self.target <= 1.0, f"target must be in (0, 1], got {self.target}"),
                  (MIN_RATE <= self.lo < self.hi < math.inf, f"need {MIN_RATE:g} <= lo < hi, finite: got lo "
                                                             f"{self.lo}, hi {self.hi}"),
                  (1.0 < self.growth < math.inf, f"growth must be > 1, got {self.growth}"),
                  (MIN_RESOLUTION <= self.resolution < 1.0,
                   f"resolution must be in [{MIN_RESOLUTION:g}, 1), got {self.resolution}"),
                  (self.stop_after >= 1 and self.extend_below >= 0 and self.probes >= 1,
                   f"stop_after and probes must be >= 1 (got {self.stop_after}, {self.probes})"))
        for ok, why in checks:
            if not ok:  # (NaN fails every comparison, so it lands here too)
                raise ValueError(why)

    def rates_below(self) -> list[float]:
        return [round(self.lo / self.growth ** k, 6) for k in range(1, self.extend_below + 1)]

    def rates(self) -> list[float]:
        n = int(math.floor(math.log(self.hi / self.lo) / math.log(self.growth) + 1e-9))
        out = [self.lo * self.growth ** i for i in range(n + 1)]
        if out[-1] < self.hi * (1 - 1e-9):
            out.append(self.hi)
        return [round(r, 6) for r in out]


@dataclass
class Capacity:
    """One policy's answer. `capacity_req_s` is None when even the lowest rate misses the target;
    `censored` says the true capacity lies outside the grid ("below" lo or "above" hi)."""

    capacity_req_s: float | None
    bracket: tuple[float | None, float | None]  # (highest passing, lowest failing) of the crossing
    censored: str | None
    points: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment), by rate
    passes_above: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def find_capacity(measure: Measure, grid: CapacityGrid, batch: int = 1) -> Capacity:
    """Scan the grid upward until `stop_after` consecutive rates fail, then narrow the first
    crossing's bracket with `grid.probes` evenly spaced rates per round. `batch` rates of a scan
    are measured at once; a rate the one-at-a-time scan would not have reached is measured but
    forgotten, so the result is the same for every batch."""
    seen: dict[float, float] = {}

    def run(rates: Sequence[float]) -> None:
        todo = [r for r in rates if r not in seen]
        if todo:
            seen.update(zip(todo, (float(a) for a in measure(todo))))

    def scan(rates: list[float], done: Callable[[float], bool]) -> None:
        for i in range(0, len(rates), batch):
            run(rates[i:i + batch])
            for k, r in enumerate(rates[i:i + batch]):
                if done(seen[r]):
                    for extra in rates[i + k + 1:i + batch]:
                        seen.pop(extra, None)
                    return

    fails_in_row = 0

    def stop_upward(att: float) -> bool:
        nonlocal fails_in_row
        fails_in_row = 0 if att >= grid.target else fails_in_row + 1  # (NaN: a failure, as below)
        return fails_in_row >= grid.stop_after

    scan(grid.rates(), stop_upward)
    if seen[min(seen)] < grid.target:
        scan(grid.rates_below(), lambda att: att >= grid.target)
    scanned = sorted(seen)
    first_fail = next((r for r in scanned if not seen[r] >= grid.target), None)
    if first_fail is None:
        return Capacity(scanned[-1], (scanned[-1], None), "above", _points(seen))
    if first_fail == scanned[0]:
        return Capacity(None, (None, first_fail), "below", _points(seen))
    passed = max(r for r in scanned if r < first_fail)
    above = [r for r in scanned if r > first_fail and seen[r] >= grid.target]
    while (first_fail - passed) > grid.resolution * passed:
        step = (first_fail - passed) / (grid.probes + 1)
        probe = [round(passed + step * (k + 1), 6) for k in range(grid.probes)]
        if all(r in (passed, first_fail) for r in probe):
            break  # the bracket is as narrow as rates are rounded (6 decimals)
        run(probe)
        for r in probe:  # the lowest failing probe bounds the crossing from above
            if not seen[r] >= grid.target:
                first_fail = r
                break
            passed = r
    return Capacity(passed, (passed, first_fail), None, _points(seen), above)


def _points(seen: dict[float, float]) -> list[tuple[float, float]]:
    return [(r, seen[r]) for r in sorted(seen)]


def policy_capacity(template: Job, grid: CapacityGrid, seeds: int = 1, processes: int = 1,
                    slo_rule: str = "gaps") -> dict:
    """`template`'s policy and workload at each rate the search asks for, over `seeds` workload
    seeds (template.seed onward); a rate's attainment pools every seed's requests, a request
    meeting its TBT SLO by `slo_rule` (`SLO_RULES`). `processes` only sets how many runs go at
    once: the answer is the same for any number."""
    if slo_rule not in SLO_RULES:
        raise ValueError(f"slo_rule must be one of {sorted(SLO_RULES)}, got {slo_rule!r}")
    key = SLO_RULES[slo_rule]

    def measure(rates: Sequence[float]) -> list[float]:
        jobs = [replace(template, rate=r, seed=template.seed + s) for r in rates for s in range(seeds)]
        res = run_jobs(jobs, processes, progress=False)
        out = []
        for i, rate in enumerate(rates):
            chunk = res[i * seeds:(i + 1) * seeds]
            n = sum(r["requests"] for r in chunk)
            if n == 0:  # nothing to judge: not a pass (nor a failure to bisect on)
                raise ValueError(f"no request arrived at {rate:g} req/s in {template.duration:g} s x {seeds} "
                                 "seed(s): give a longer --duration, more --seeds or a higher --lo")
            out.append(sum(r[key] * r["requests"] for r in chunk) / n)
        return out

    cap = find_capacity(measure, grid, batch=max(1, processes // seeds))
    return {"policy": template.policy, "capacity_req_s": cap.capacity_req_s, "target": grid.target,
            "resolution": grid.resolution, "seeds": seeds, "slo_rule": slo_rule, **cap.as_dict()}


def capacity_table(rows: list[dict], baseline: str = "sglang") -> str:
    """Markdown: capacity per policy and its ratio to the baseline policy's."""
    base = next((r["capacity_req_s"] for r in rows if r["policy"] == baseline), None)
    lines = [f"| policy | capacity at {100 * rows[0]['target']:g}% (req/s) | vs {baseline} | bracket |",
             "|---|---|---|---|"]
    for r in rows:
        cap = r["capacity_req_s"]
        cell = "below grid" if cap is None else f"{cap:.2f}" + (" (grid max)" if r["censored"] == "above" else "")
        ratio = f"{cap / base:.2f}x" if cap and base else "-"
        lo, hi = r["bracket"]
        lines.append(f"| {r['policy']} | {cell} | {ratio} | {lo} .. {hi} |")
    return "\n".join(lines)


__all__ = ["SLO_RULES", "SLO_RULE_HELP", "Capacity", "CapacityGrid", "capacity_table", "find_capacity",
           "policy_capacity"]
