"""Run simulations: one (workload, profile, policy) at a time, or many jobs in worker processes."""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from superinfer_sgl.rotasched.vlt import VltParams
from superinfer_sgl.sim.engine import SimConfig, Simulator
from superinfer_sgl.sim.metrics import summarize
from superinfer_sgl.sim.policies import make_policy
from superinfer_sgl.sim.profile import Profile, resolve_profile
from superinfer_sgl.sim.workload import (
    Workload, load_azure, load_sharegpt_json, load_table, sharegpt_like,
)


AZURE_KINDS = ("conv", "code")  # ../shared/data/AzureLLMInferenceTrace_{kind}.csv


def build_workload(spec: str, rate: float, duration: float, seed: int = 0,
                   ttft_slo: float | None = None, tbt_slo: float | None = None) -> Workload:
    """sharegpt-like | azure:conv | azure:code | path to a ShareGPT .json, .csv or .jsonl trace.

    Azure traces keep their own burstiness; `rate` rescales their timestamps (0: as recorded).
    They ignore `seed`: `azure:KIND@START` takes the window from START seconds into the trace
    instead of its beginning (another stretch of the same hour, for held-out checks).
    SLOs given here replace the trace's (or the 5 s / 100 ms defaults).
    """
    if spec == "sharegpt-like":
        w = sharegpt_like(rate, duration, seed)
    elif spec.startswith("azure:"):
        kind, _, start = spec.split(":", 1)[1].partition("@")
        if kind not in AZURE_KINDS:
            raise ValueError(f"{spec}: the Azure traces are {' and '.join(f'azure:{k}' for k in AZURE_KINDS)}")
        w = load_azure(kind, duration=duration, rate=rate or None, start=azure_start(spec, start))
    else:
        path = Path(spec)
        if path.suffix == ".json":
            w = load_sharegpt_json(path, rate, duration, seed)
        else:
            w = load_table(path)
    if ttft_slo is not None or tbt_slo is not None:
        w = w.with_slo(ttft_slo or 5.0, tbt_slo or 0.1)
    return w


def azure_start(spec: str, start: str) -> float:
    """The START of `azure:KIND@START` in seconds (0 without one)."""
    if not start:
        return 0.0
    try:
        value = float(start)
    except ValueError:
        raise ValueError(f"{spec}: START must be seconds into the trace, e.g. azure:conv@1200") from None
    if value < 0:
        raise ValueError(f"{spec}: START must be >= 0")
    return value


def simulate(workload: Workload, profile: Profile, policy: str, config: SimConfig | None = None) -> dict:
    """Run one policy over one workload; the summary plus the wall time the simulation took."""
    t0, c0 = time.perf_counter(), time.process_time()
    sim = Simulator(workload, profile, make_policy(policy), config).run()
    out = summarize(sim)
    out["wall_s"] = time.perf_counter() - t0
    out["cpu_s"] = time.process_time() - c0  # less sensitive than wall time to a shared machine
    return out


SERVER_POLICIES = ("goodput", "paper")  # our server as shipped, with its default quantum


@dataclass(frozen=True)
class Job:
    """A picklable simulation request for worker processes."""

    profile: str
    policy: str
    workload: str = "sharegpt-like"
    rate: float = 10.0
    duration: float = 120.0
    seed: int = 0
    ttft_slo: float | None = None
    tbt_slo: float | None = None
    budget_blocks: int = 2400
    kv_tokens: int | None = None
    lookahead: bool = False
    mixed_chunk: bool = False
    ignore_eos: bool = True
    # None: 0 (the paper's rule) for the lvf-* policies of the paper scenario; the server's
    # default quantum for `goodput` and `paper` (the server as shipped)
    min_stint_s: float | None = None
    vlt: tuple[float, float, float] = (3.0, 0.5, 0.0)
    max_best_effort_wait_s: float = SimConfig.max_best_effort_wait_s
    step_jitter: float = 0.0  # SimConfig.step_jitter, seeded with the workload's seed
    measured_costs: bool = SimConfig.measured_costs  # the server's meter; False: the profile's costs
    running_reserve: float | None = None  # SimConfig.running_reserve (None: the policy's)
    mix_prefill: str = SimConfig.mix_prefill  # SimConfig.mix_prefill
    ttft_shedding: bool = SimConfig.ttft_shedding  # SimConfig.ttft_shedding
    # Requests that may stop at EOS (ignore_eos False) ask for up to this many tokens
    # (Workload.with_max_new_tokens; None: exactly their trace length)
    max_new_tokens: int | None = None
    tags: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and self.ignore_eos:
            raise ValueError("max_new_tokens applies to requests that may stop at EOS (ignore_eos False): "
                             "a fixed-length request decodes all it asks for")

    def config(self) -> SimConfig:
        return SimConfig(budget_blocks=self.budget_blocks, vlt=VltParams(*self.vlt),
                         lookahead=self.lookahead, mixed_chunk=self.mixed_chunk,
                         ignore_eos=self.ignore_eos, min_stint_s=self.stint_s(),
                         max_best_effort_wait_s=self.max_best_effort_wait_s,
                         step_jitter=self.step_jitter, jitter_seed=self.seed,
                         measured_costs=self.measured_costs, running_reserve=self.running_reserve,
                         mix_prefill=self.mix_prefill, ttft_shedding=self.ttft_shedding)

    def stint_s(self) -> float | None:
        """The quantum: as given; else None (the server's default) for our server's policies,
        0 (the paper's rule) for the paper scenario's lvf-* policies."""
        if self.min_stint_s is not None or self.policy in SERVER_POLICIES:
            return self.min_stint_s
        return 0.0


def run_job(job: Job) -> dict:
    profile = resolve_profile(job.profile)
    if job.kv_tokens is not None:
        profile = profile.with_server(kv_tokens=job.kv_tokens)
    wl = build_workload(job.workload, job.rate, job.duration, job.seed, job.ttft_slo, job.tbt_slo)
    if job.max_new_tokens is not None:
        wl = wl.with_max_new_tokens(job.max_new_tokens)
    out = simulate(wl, profile, job.policy, job.config())
    out.update(rate=job.rate, budget_blocks=job.budget_blocks, job={k: v for k, v in asdict(job).items()})
    out.update(job.tags)
    return out


def run_jobs(jobs: list[Job], processes: int = 1, progress: bool = True) -> list[dict]:
    """Run jobs (in `processes` workers when > 1); results in job order."""
    if processes <= 1:
        results = []
        for i, job in enumerate(jobs):
            results.append(run_job(job))
            if progress:
                _report(i, len(jobs), job, results[-1])
        return results
    with ProcessPoolExecutor(processes) as pool:
        results = []
        for i, (job, res) in enumerate(zip(jobs, pool.map(run_job, jobs))):
            results.append(res)
            if progress:
                _report(i, len(jobs), job, res)
        return results


def _report(i: int, n: int, job: Job, res: dict) -> None:
    print(f"[{i + 1}/{n}] {job.profile} {job.policy} rate {job.rate:g} budget {job.budget_blocks}: "
          f"TTFT {res['ttft_attainment']:.3f} TBT {res['tbt_attainment']:.3f} "
          f"({res['wall_s']:.1f} s)", flush=True)


__all__ = ["Job", "build_workload", "run_job", "run_jobs", "simulate"]
