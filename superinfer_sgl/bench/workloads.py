"""Seeded request sets and arrival schedules.

A workload is a list of `BenchRequest`s (token lengths + SLO) and, per sweep point, a list of
arrival offsets in seconds. Everything here is a pure function of its seed, so both systems of an
A/B see exactly the same requests at exactly the same times.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..rotasched.slo import Slo, SloClasses


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. `arrival_s` is set only for traces replayed as recorded."""

    idx: int
    prompt_tokens: int
    output_tokens: int
    slo: Slo
    slo_class: str | None = None
    arrival_s: float | None = None

    def __post_init__(self) -> None:
        assert self.idx >= 0 and self.prompt_tokens >= 1 and self.output_tokens >= 1, self


@dataclass(frozen=True)
class LengthDist:
    """Log-normal token lengths (median, sigma of log), clipped to [lo, hi] and scaled."""

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        assert self.median > 0 and self.sigma >= 0 and 1 <= self.lo <= self.hi, self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(raw), self.lo, self.hi).astype(int)

    def scaled(self, factor: float, lo: int | None = None, hi: int | None = None) -> "LengthDist":
        return LengthDist(self.median * factor, self.sigma, lo or self.lo, hi or self.hi)


# ShareGPT-like lengths: log-normals chosen to match published ShareGPT statistics (mean prompt
# about 250 tokens, mean output about 220 tokens, both long-tailed, prompts clipped at 1024).
# Not fitted to the dataset itself (no download here); see docs/ab.md.
SHAREGPT_INPUT = LengthDist(median=150, sigma=1.0, lo=4, hi=1024)
SHAREGPT_OUTPUT = LengthDist(median=150, sigma=0.9, lo=4, hi=1024)


def sharegpt_like(n: int, seed: int, slo: Slo, inputs: LengthDist = SHAREGPT_INPUT,
                  outputs: LengthDist = SHAREGPT_OUTPUT) -> list[BenchRequest]:
    """n requests with ShareGPT-like (or the given) length distributions, one SLO for all."""
    rng = np.random.default_rng(seed)
    ins, outs = inputs.sample(rng, n), outputs.sample(rng, n)
    return [BenchRequest(i, int(a), int(b), slo) for i, (a, b) in enumerate(zip(ins, outs))]


def assign_classes(reqs: Sequence[BenchRequest], mix: Mapping[str, float], classes: SloClasses,
                   seed: int) -> list[BenchRequest]:
    """Give each request an SLO class drawn with the weights in `mix` (a mixed-SLO workload)."""
    names = list(mix)
    unknown = [n for n in names if n not in classes]
    if unknown:
        raise ValueError(f"SLO classes {unknown} are not defined; known: {sorted(classes)}")
    weights = np.array([mix[n] for n in names], dtype=float)
    if weights.min() < 0 or weights.sum() <= 0:
        raise ValueError(f"class weights must be >= 0 and not all 0: {dict(mix)}")
    rng = np.random.default_rng(seed + 7919)
    picks = rng.choice(len(names), size=len(reqs), p=weights / weights.sum())
    return [replace(r, slo=classes[names[k]], slo_class=names[k]) for r, k in zip(reqs, picks)]


def parse_mix(text: str) -> dict[str, float]:
    """'interactive:0.5,batch:0.5' -> {'interactive': 0.5, 'batch': 0.5}."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition(":")
        mix[name.strip()] = float(weight) if weight else 1.0
    if not mix:
        raise ValueError(f"empty class mix {text!r}")
    return mix


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of `rate` req/s; the first request at t=0."""
    assert rate > 0 and n >= 0
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def search_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """The live capacity search's arrivals at `rate` in a repeat seeded `seed` (capacity_live.point_at):
    the same for every system at the same rate; sim/capacity_validate.py draws them again."""
    return poisson_arrivals(n, rate, seed * 100_000 + int(round(rate * 1000)) % 100_000)


def recorded_arrivals(reqs: Sequence[BenchRequest], time_scale: float = 1.0) -> list[float]:
    """Trace timestamps as offsets from the first request, stretched by time_scale (2 = half rate)."""
    assert time_scale > 0
    stamps = [r.arrival_s for r in reqs]
    if any(s is None for s in stamps):
        raise ValueError("this workload has no recorded timestamps; use Poisson arrivals")
    t0 = min(stamps)  # type: ignore[type-var]
    return [(s - t0) * time_scale for s in stamps]  # type: ignore[operator]


def offered_rate(arrivals: Sequence[float]) -> float:
    """Mean arrival rate of a schedule (req/s): n-1 gaps over its span."""
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    return (len(arrivals) - 1) / span if span > 0 else float("inf")
